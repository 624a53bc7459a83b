#!/usr/bin/env python3
# PyTorch's symmetric-memory all-reduces timed the way symkv-bench allreduce times symkv's:
# CUDA graphs of ~100 calls, replayed, timed with events, median; NCCL as the in-run baseline.
"""Time torch.ops.symm_mem.one_shot_all_reduce and two_shot_all_reduce_ in CUDA graphs.

Run on a GPU host where PyTorch is installed, one process per GPU:

    torchrun --nproc-per-node 2 bench/torch_symm_mem.py [--sizes 1K,4K,...] [--json-out FILE]
    python3 -m torch.distributed.run --nproc-per-node 4 bench/torch_symm_mem.py

Prints a table (rank 0), or with --json one object in symkv-bench's format (docs/benchmarks.md):
rows "torch/<op>/bf16/<size>/<n>pe" in microseconds per call with ncclAllReduce captured the same
way as the baseline, so that the numbers line up with `symkv-bench allreduce` of the same run.
"""
import os

# NVLink multicast must stay off on the shared GPU hosts (DESIGN.md, GPU-HOSTS.md): set before
# torch (and NCCL, NVSHMEM) read them.
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(s[:-1]) * mult[s[-1]]
    return int(s)


def fmt_size(b):
    if b >= 1 << 20 and b % (1 << 20) == 0:
        return f"{b >> 20}MiB"
    if b >= 1 << 10 and b % (1 << 10) == 0:
        return f"{b >> 10}KiB"
    return f"{b}B"


def time_graph(fn, calls, reps, stream):
    """Median microseconds per call of fn() captured `calls` times in one CUDA graph."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # eager warm-up (rendezvous, lazy init) outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(calls):
                fn()
    g.replay()  # warm-up replay
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        # the first replay absorbs the ranks' start skew; the second is timed back to back
        g.replay()
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    del g
    return statistics.median(times)


def slowest(us, device):
    """The slowest rank's value (NaN stays NaN)."""
    t = torch.tensor([us if us == us else -1.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = t.item()
    return float("nan") if v < 0 else v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="comma list (1K,4K,...); default powers of 2, 1K..64M")
    ap.add_argument("--min", default="1K")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--calls", type=int, default=100, help="calls per graph (fewer above 1 MiB)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--json-out", default=None, help="also write the JSON object to this file")
    args = ap.parse_args()

    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    else:
        sizes, s, hi = [], parse_size(args.min), parse_size(args.max)
        while s <= hi:
            sizes.append(s)
            s *= 2

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        if rank == 0:
            print(f"torch_symm_mem.py: this PyTorch has no symmetric memory ({e})", file=sys.stderr)
        dist.destroy_process_group()
        return 1
    group_name = dist.group.WORLD.group_name
    stream = torch.cuda.Stream()
    dtype = torch.bfloat16
    gen = torch.Generator(device=device)
    gen.manual_seed(1234 + rank)

    rows = []
    for size in sizes:
        numel = size // dtype.itemsize
        calls = max(8, args.calls * (1 << 20) // size) if size > (1 << 20) else args.calls
        res = {}
        # ncclAllReduce on an ordinary tensor: the baseline
        x = torch.empty(numel, dtype=dtype, device=device)
        x.copy_(torch.rand(numel, generator=gen, device=device, dtype=torch.float32) * 1e-30)
        res["nccl"] = time_graph(lambda: dist.all_reduce(x), calls, args.reps, stream)
        # one-shot: out of place (into a preallocated output when the _out variant exists)
        inp = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(inp, group=group_name)
        inp.copy_(torch.rand(numel, generator=gen, device=device, dtype=torch.float32) * 1e-30)
        out = torch.empty_like(inp)
        ops = torch.ops.symm_mem
        if hasattr(ops, "one_shot_all_reduce_out"):
            one = lambda: ops.one_shot_all_reduce_out(inp, "sum", group_name, out)  # noqa: E731
        else:
            one = lambda: ops.one_shot_all_reduce(inp, "sum", group_name)  # noqa: E731
        for name, fn in (("one_shot", one), ("two_shot", lambda: ops.two_shot_all_reduce_(inp, "sum", group_name))):
            try:
                res[name] = time_graph(fn, calls, args.reps, stream)
            except Exception as e:  # unsupported size or alignment: report, do not stop
                res[name] = float("nan")
                if rank == 0:
                    print(f"torch_symm_mem.py: {name} at {fmt_size(size)} failed: {str(e).splitlines()[0]}",
                          file=sys.stderr)
                torch.cuda.synchronize()
        del inp, out, x
        for name in ("nccl", "one_shot", "two_shot"):
            res[name] = slowest(res[name], device)
        for name in ("one_shot", "two_shot", "nccl"):
            v = res[name]
            if v != v:
                continue
            row = {"name": f"torch/{name}/bf16/{fmt_size(size)}/{world}pe", "value": v, "unit": "us",
                   "better": "lower"}
            if name != "nccl" and res["nccl"] == res["nccl"]:
                row.update(baseline_name="ncclAllReduce in a CUDA graph (torch)", baseline=res["nccl"],
                           ratio=v / res["nccl"])
            rows.append(row)

    if rank == 0:
        obj = {
            "bench": "allreduce-torch",
            "host": socket.gethostname(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join(sys.argv),
            "config": {"pes": world, "dtype": "bf16", "op": "sum", "calls_per_graph": args.calls,
                       "reps": args.reps, "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                       "multicast": "off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0)"},
            "rows": rows,
        }
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(obj, f, indent=1)
        if args.json:
            print(json.dumps(obj))
        else:
            print(f"{'name':40s} {'value':>10s} unit  {'baseline':38s} {'baseline':>10s} {'ratio':>7s}")
            for r in rows:
                if "baseline" in r:
                    print(f"{r['name']:40s} {r['value']:10.3f} us    {r['baseline_name']:38s} "
                          f"{r['baseline']:10.3f} {r['ratio']:7.3f}")
                else:
                    print(f"{r['name']:40s} {r['value']:10.3f} us")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
