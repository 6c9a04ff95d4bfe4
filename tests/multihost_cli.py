"""One process of a multi-process `specjax` command on loopback (tests/test_sharding.py).

    python tests/multihost_cli.py PORT PROCESS_ID NUM_PROCESSES SPECJAX_ARGS...

Each process has 4 CPU devices and joins the run through the CLI's own flags (--coordinator
127.0.0.1:PORT, --num-processes, --process-id), as a user on several hosts would."""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"  # the forced host devices, even where a GPU is present
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import faulthandler  # noqa: E402

from specjax.cli import main  # noqa: E402

if __name__ == "__main__":
    faulthandler.dump_traceback_later(500, exit=True)  # a hung collective ends the process, with its stack
    port, process_id, num_processes, *argv = sys.argv[1:]
    sys.exit(main(argv + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", num_processes,
                          "--process-id", process_id]))
