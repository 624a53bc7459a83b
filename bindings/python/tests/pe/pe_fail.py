"""Run on 4 PEs: rank 2 fails (argv[1]: "raise" an uncaught exception after init, "with" one
inside `with symkv.init()`, "exit" sys.exit(3)); the others wait in a barrier."""
import sys
import time

import symkv

mode = sys.argv[1]
if mode == "with":
    with symkv.init() as ctx:
        if ctx.rank == 2:
            raise ValueError("rank 2 failed on purpose")
        ctx.barrier()
        time.sleep(30)
    sys.exit(0)
ctx = symkv.init()
if ctx.rank == 2:
    if mode == "raise":
        raise ValueError("rank 2 failed on purpose")
    sys.exit(3)
ctx.barrier()
time.sleep(30)  # never reached in time: the launcher stops everyone
