#!/usr/bin/env python3
# symkv's torch ops and Triton all-reduce timed beside their baselines in the same run.
"""Time symkv.torch's all-reduce op (eager, compiled, in a CUDA graph) beside
torch.ops.symm_mem.one_shot_all_reduce and dist.all_reduce, the Triton one-shot beside symkv's
CUDA one, and the op's Python-side overhead over the bare C call.

    torchrun --nproc-per-node 2 bench/torch_symkv.py [--sizes 4K,64K,1M] [--json-out FILE]
    python3 bench/torch_symkv.py --device cpu          # overhead only, one process, host backend
    torchrun --nproc-per-node 2 bench/torch_symkv.py --device cpu

CUDA rows (bf16, microseconds per call, slowest rank, median of --reps):
  symkv/op_eager, symkv/op_compiled   back-to-back eager calls timed with events; baseline: the
                                      bare C call (ctypes, same arguments) in the same loop
  symkv/op_graph                      --calls calls captured in one CUDA graph, replayed;
                                      baseline: dist.all_reduce (NCCL) captured the same way,
                                      when every rank has its own GPU (NCCL refuses two ranks on
                                      one GPU; then torch's symm_mem one-shot is the baseline)
  torch/symm_mem_one_shot_graph       torch.ops.symm_mem.one_shot_all_reduce in a graph
  triton/oneshot_graph                symkv.triton.AllReduce in a graph; baseline: the op with
                                      algo="oneshot" in a graph
Overhead rows (both devices): host microseconds per call of the in-place and out-of-place op
through torch.ops (torch's dispatch into the Python kernel), through the Python API
(Group.all_reduce_ / all_reduce: the kernel called directly in plain eager mode), and of a no-op
Python-kernel op (the dispatch floor), against the bare C call (plus torch.empty_like for the
out-of-place ones), interleaved rounds, median; target: at most 5 us over the C call (issue 20).
"""
import os

os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bindings",
                                "python"))
import symkv.torch as st  # noqa: E402

from torch_symm_mem import fmt_size, parse_size, time_graph  # noqa: E402


def slowest(us, device):
    t = torch.tensor([us if us == us else float("-inf")], dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
            t = t.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = t.item()
    return float("nan") if v == float("-inf") else v


def host_us(variants, calls, reps, sync):
    """Median host microseconds per call of each variant, rounds interleaved."""
    res = {k: [] for k in variants}
    for _ in range(reps):
        for k, fn in variants.items():
            fn()
            sync()
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            res[k].append((time.perf_counter() - t0) * 1e6 / calls)
    return {k: statistics.median(v) for k, v in res.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sizes", default="4K,64K,1M")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--overhead-calls", type=int, default=5000)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--symm-mem", choices=("auto", "on", "off"), default="auto",
                    help="time torch's symm_mem one-shot (auto: only when every rank has its own "
                    "GPU; on one shared GPU its spinning kernels may starve each other for good)")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    cuda = args.device == "cuda"
    if "RANK" in os.environ:
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            ngpu = torch.cuda.device_count()
            world = int(os.environ["WORLD_SIZE"])
            shared = world > ngpu
            dev = torch.device("cuda", local % ngpu)
            torch.cuda.set_device(dev)
            dist.init_process_group("gloo" if shared else "nccl",
                                    device_id=None if shared else dev)
        else:
            dev, shared = torch.device("cpu"), False
            dist.init_process_group("gloo")
        g = st.init(device=dev)
    else:  # one process, no torchrun: a HashStore bootstraps a one-PE group
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        shared = False
        g = st.Group(store=dist.HashStore(), rank=0, world_size=1, device=dev)
    rank, world = g.rank, g.world_size
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []

    def row(name, v, base_name=None, base=None, **extra):
        v = slowest(v, dev)
        r = {"name": name, "value": v, "unit": "us", "better": "lower"}
        if base is not None:
            base = slowest(base, dev)
            r.update(baseline_name=base_name, baseline=base, ratio=v / base if base else None)
        r.update(extra)
        rows.append(r)

    # -- Python-side overhead of the op over the bare C call ---------------------------------
    x = torch.randn(1024, device=dev)
    o = torch.empty_like(x)
    stream = (lambda: torch._C._cuda_getCurrentRawStream(dev.index) or None) if cuda else \
        (lambda: None)
    fn, h, gid = g._fn, g._h, g.id
    ar, ar_ = torch.ops.symkv.all_reduce, torch.ops.symkv.all_reduce_

    def c_call():
        fn(h, x.data_ptr(), o.data_ptr(), 1024, 3, 0, 0, 0, stream())

    def c_call_alloc():
        y = torch.empty_like(x)
        fn(h, x.data_ptr(), y.data_ptr(), 1024, 3, 0, 0, 0, stream())
        return y

    # the floor: an op with the same schema whose Python kernel does nothing (torch's dispatch
    # into Python, which every Python-registered op pays)
    nlib = torch.library.Library("symkv_bench", "DEF")
    nlib.define("noop(Tensor(a!) x, int group, str op, str algo, int channel) -> ()")
    for key in ("CPU", "CUDA"):
        nlib.impl("noop", lambda x, gr, op, algo, ch: None, key)
    noop = torch.ops.symkv_bench.noop
    t = host_us({"c": c_call, "c_alloc": c_call_alloc, "op_": lambda: ar_(x, gid, "sum", "auto", 0),
                 "op": lambda: ar(x, gid, "sum", "auto", 0),
                 "noop": lambda: noop(x, gid, "sum", "auto", 0),
                 "api_": lambda: g.all_reduce_(x), "api": lambda: g.all_reduce(x)},
                args.overhead_calls, args.reps, sync)
    tag = "%s/fp32/4KiB/%dpe" % (args.device, world)
    row("symkv/c_call/" + tag, t["c"])
    row("symkv/op_inplace/" + tag, t["op_"], "bare C call (ctypes)", t["c"])
    row("symkv/op/" + tag, t["op"], "bare C call + torch.empty_like", t["c_alloc"])
    row("symkv/api_inplace/" + tag, t["api_"], "bare C call (ctypes)", t["c"])
    row("symkv/api/" + tag, t["api"], "bare C call + torch.empty_like", t["c_alloc"])
    row("symkv/overhead_inplace/" + tag, t["op_"] - t["c"], target=5.0)
    row("symkv/overhead_out_of_place/" + tag, t["op"] - t["c_alloc"], target=5.0)
    row("symkv/overhead_api_inplace/" + tag, t["api_"] - t["c"], target=5.0)
    row("symkv/overhead_api_out_of_place/" + tag, t["api"] - t["c_alloc"], target=5.0)
    row("torch/dispatch_to_python_noop/" + tag, t["noop"])

    if cuda:
        s = torch.cuda.Stream()
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError:
            symm_mem = None
        try:
            import symkv.triton as skt
            tri = skt.AllReduce(g, max_bytes=max(s for s in sizes if s <= (4 << 20)), blocks=16)
        except ImportError as e:  # no triton: the Triton rows are left out
            print("torch_symkv.py: no Triton rows: %s" % e, file=sys.stderr)
            tri = None
        dtype = torch.bfloat16
        for size in sizes:
            numel = size // 2
            calls = max(8, args.calls * (1 << 20) // size) if size > (1 << 20) else args.calls
            x = torch.randn(numel, device=dev).to(dtype) * 1e-3
            tg = "bf16/%s/%dpe" % (fmt_size(size), world)
            c = torch.empty_like(x)
            f_c = lambda: fn(h, x.data_ptr(), c.data_ptr(), numel, 1, 0, 0, 0, stream())  # noqa
            f_op = lambda: ar(x, gid, "sum", "auto", 0)  # noqa: E731
            comp = torch.compile(lambda a: st.all_reduce(a), fullgraph=True)
            f_comp = lambda: comp(x)  # noqa: E731
            f_comp()
            t = host_us({"c": f_c, "op": f_op, "comp": f_comp}, args.calls, args.reps, sync)
            row("symkv/op_eager/" + tg, t["op"], "bare C call, eager", t["c"])
            row("symkv/op_compiled/" + tg, t["comp"], "bare C call, eager", t["c"])
            base_name, base = None, None
            if not shared:
                y = x.clone()
                base = time_graph(lambda: dist.all_reduce(y), calls, args.reps, s)
                base_name = "dist.all_reduce (NCCL) in a CUDA graph"
                row("torch/dist_all_reduce_graph/" + tg, base)
            one = float("nan")
            if symm_mem is not None and (args.symm_mem == "on" or
                                         (args.symm_mem == "auto" and not shared)):
                try:
                    inp = symm_mem.empty(numel, dtype=dtype, device=dev)
                    symm_mem.rendezvous(inp, group=dist.group.WORLD.group_name)
                    inp.copy_(x)
                    gn = dist.group.WORLD.group_name
                    one = time_graph(lambda: torch.ops.symm_mem.one_shot_all_reduce(inp, "sum", gn),
                                     calls, args.reps, s)
                except Exception as e:  # report and go on (one GPU: may be unsupported)
                    if rank == 0:
                        print("torch_symkv.py: symm_mem one_shot_all_reduce at %s failed: %s"
                              % (fmt_size(size), str(e).splitlines()[0]), file=sys.stderr)
                    torch.cuda.synchronize()
            if one == one:
                row("torch/symm_mem_one_shot_graph/" + tg, one, base_name, base)
                if base is None:
                    base_name, base = "torch.ops.symm_mem.one_shot_all_reduce in a graph", one
            op_g = time_graph(f_op, calls, args.reps, s)
            row("symkv/op_graph/" + tg, op_g, base_name, base)
            if tri is not None and size <= tri.max_bytes:
                one_g = time_graph(lambda: ar(x, gid, "sum", "oneshot", 0), calls, args.reps, s)
                out = torch.empty_like(x)
                tri_g = time_graph(lambda: tri(x, out=out), calls, args.reps, s)
                tri.check()
                row("symkv/op_oneshot_graph/" + tg, one_g)
                row("triton/oneshot_graph/" + tg, tri_g, "symkv op, algo=oneshot, in a graph",
                    one_g)
            if rank == 0:
                write_json(args, world, shared, rows, final=False)

    if rank == 0:
        write_json(args, world, shared, rows, final=True)
    g.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def write_json(args, world, shared, rows, final):
    """The JSON so far (after every size: a later size that hangs loses nothing before it);
    the table once at the end."""
    obj = {"bench": "torch-symkv", "host": socket.gethostname(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": " ".join(sys.argv),
           "config": {"pes": world, "device": args.device, "shared_gpu": shared,
                      "op_kernels": "python" if args.device.upper() in st._py_kernels else "c++",
                      "torch": torch.__version__, "reps": args.reps, "calls": args.calls},
           "rows": rows}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(obj, f, indent=1)
    if not final:
        return
    print("torch.ops.symkv.* kernels: %s" % obj["config"]["op_kernels"])
    print("%-44s %10s unit  %-38s %10s %7s" % ("name", "value", "baseline", "baseline",
                                              "ratio"))
    for r in rows:
        if "baseline" in r:
            print("%-44s %10.3f us    %-38s %10.3f %7.3f" % (
                r["name"], r["value"], r["baseline_name"], r["baseline"], r["ratio"] or 0))
        else:
            print("%-44s %10.3f us%s" % (r["name"], r["value"], "    (target <= %.1f)"
                                         % r["target"] if "target" in r else ""))


if __name__ == "__main__":
    sys.exit(main())
