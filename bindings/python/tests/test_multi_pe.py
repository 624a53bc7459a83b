"""Several PEs through the real launcher (symkv-run): publish on one PE / lookup + fetch on
the others, context managers releasing, logging from background threads, failures."""
import re
import time

import pytest


def test_kv_across_four_pes(pes):
    r = pes(4, "pe_kv.py")
    assert r.ok(), r


def test_context_managers_release(pes):
    r = pes(4, "pe_release.py")
    assert r.ok(), r


def test_logging_from_background_threads_and_exit(pes):
    r = pes(2, "pe_log.py", env={"SKV_DEBUG": "INFO"})
    assert r.ok(), r
    assert "Fatal Python error" not in r.err and "Segmentation" not in r.err
    # rank 0's store logged the PEs leaving during the exit-time finalize, through logging
    late = [l for l in r.lines(0) if l.startswith("EXIT-LOG")]
    assert late and int(late[0].split()[1]) >= 1, r


@pytest.mark.parametrize("mode", ["raise", "with", "exit"])
def test_error_in_one_pe_fails_the_launcher(pes, mode):
    t = time.time()
    r = pes(4, "pe_fail.py", mode, timeout=60)
    assert r.rc != 0 and r.rc != 124, r           # failed, and not by the launcher's timeout
    assert time.time() - t < 40, "a failing PE should not hang the others: %s" % r
    if mode in ("raise", "with"):
        assert any("ValueError: rank 2 failed on purpose" in l for l in r.lines(2)), r
    else:
        assert "exited with status" in r.err, r
    # the peers' failures, those they got to report, are symkv errors naming what happened; a
    # peer stopped by the launcher's SIGTERM while printing its traceback leaves no last line
    finals = [l for k in (0, 1, 3) for l in r.lines(k)
              if re.match(r"[A-Za-z_][\w.]*: ", l) and not l.startswith("Traceback")]
    assert all(l.startswith("symkv.") for l in finals), r
