"""Pieces shared by the peer benchmarks (peers.py, peers_mla.py): their common options and the L2
flush, the same two methods as `kvq bench` (tools/kvq/bench_gpu.hpp)."""
import time

import torch


def add_common_args(ap, batch, context, reps, warmup):
    ap.add_argument("--batch", default=batch)
    ap.add_argument("--context", default=context)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--flush", choices=["read", "write"], default="read")
    ap.add_argument("--gap-ms", type=int, default=0,
                    help="idle GPU before each timed series (ms), as `kvq bench decode / mla --gap-ms`")


def settle(gap_ms):
    """gap_ms of idle GPU before a timed series (the device synchronized, then the host asleep), so that the series
    does not start under the power state the one before it left; nothing for 0."""
    if gap_ms > 0:
        torch.cuda.synchronize()
        time.sleep(gap_ms / 1000.0)


def flush_buffer(dev):
    """(buffer of max(4 x L2, 256 MiB) bytes, L2 bytes)."""
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    return torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device=dev), l2


def flush_l2(buf, mode, i):
    """read: a read-only reduction over the buffer (the L2 keeps only clean lines); write: a memset
    of it (the earlier method, whose dirty lines are written back during the timed run)."""
    if mode == "write":
        buf.fill_(i & 0xFF)
    else:
        buf.view(torch.int32).sum()  # the scalar result is discarded
