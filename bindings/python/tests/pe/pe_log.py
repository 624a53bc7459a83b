"""Run on 2 PEs with SKV_DEBUG=INFO: symkv's lines reach Python's logging (logger "symkv"),
including those of rank 0's bootstrap server thread; the context is left open at exit (the
atexit hook finalizes it) and a background-thread log line must not crash the shutdown."""
import atexit
import logging
import threading

records = []
at_start = []


def report():
    # Registered before symkv's exit hooks, so it runs after them: the lines of the finalize
    # that symkv's hook made still went through logging.
    late = [r for r in records[at_start[0]:] if "left" in r.getMessage()]
    print("EXIT-LOG %d" % len(late), flush=True)


atexit.register(report)

import symkv  # noqa: E402


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)


logging.getLogger("symkv").addHandler(Keep())
logging.getLogger("symkv").setLevel(logging.DEBUG)
ctx = symkv.init()
ctx.barrier()
main = threading.get_ident()
assert records, "no symkv log record reached logging"
subs = {getattr(r, "symkv_subsys", None) for r in records}
assert "INIT" in subs and "BOOT" in subs, subs
assert all(r.name == "symkv" for r in records)
if ctx.rank == 0:
    assert any(r.thread != main and "joined" in r.getMessage() for r in records), \
        [r.getMessage() for r in records]
symkv.log.message("WARN", "hello from python", "KV")
assert records[-1].levelno == logging.WARNING and "hello from python" in records[-1].getMessage()
assert records[-1].symkv_subsys == "KV"
at_start.append(len(records))
print("OK", ctx.rank)
# ctx stays open: symkv's atexit hook finalizes it (its lines are logged during shutdown).
