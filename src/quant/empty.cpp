// Keeps kvq_quant non-empty while its sources are added.
