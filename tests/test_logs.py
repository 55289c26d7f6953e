"""jaxserve.logs: third-party INFO held back, ours kept; log lines never land inside a progress bar."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap


def run_py(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_third_party_info_is_quiet_ours_is_not():
    err = run_py("""
        import logging
        from jaxserve.logs import setup_logging
        setup_logging()
        logging.getLogger("absl").info("ABSL-NOISE")
        logging.getLogger("orbax.checkpoint._src").info("ORBAX-NOISE")
        logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu': nope")
        logging.getLogger("orbax").warning("ORBAX-WARNING")
        logging.getLogger("jaxserve.engine").info("OURS")
    """)
    assert "ABSL-NOISE" not in err and "ORBAX-NOISE" not in err and "Unable to initialize" not in err, err
    assert "ORBAX-WARNING" in err  # warnings still show
    assert re.search(r"^\d\d:\d\d:\d\d INFO jaxserve.engine: OURS$", err, flags=re.M), err


def test_log_line_during_a_bar_starts_on_its_own_line():
    err = run_py("""
        import logging, sys
        from tqdm import tqdm
        from jaxserve.logs import setup_logging
        setup_logging()
        with tqdm(total=4, desc="BAR", file=sys.stderr, disable=False, mininterval=0) as bar:
            bar.update(2)
            logging.getLogger("jaxserve.t").info("MID")
            bar.update(2)
    """)
    # tqdm.write clears the bar first (\\r), so the record begins a line; a plain handler would append
    # it to the bar's text.
    assert re.search(r"(^|\r|\n)\d\d:\d\d:\d\d INFO jaxserve.t: MID\n", err), repr(err)
    assert not re.search(r"\|[^\r\n]*\d\d:\d\d:\d\d INFO", err), repr(err)


def test_progress_without_a_terminal_is_two_log_lines():
    err = run_py("""
        from jaxserve.logs import progress, setup_logging
        setup_logging()
        assert list(progress(range(5), "converting", unit="tensor")) == list(range(5))
    """)  # stderr is a pipe here, as in a log file or CI
    assert "%|" not in err and "\r" not in err, repr(err)
    assert re.search(r"INFO jaxserve: converting: 5 tensors$", err, flags=re.M), err
    assert re.search(r"INFO jaxserve: converting: done, 5 tensors in [\d.]+ s$", err, flags=re.M), err
