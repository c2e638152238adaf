"""One process of tests/test_distributed.py: join a 2-process job (4 fake CPU devices each), generate on a
dp 2 x tp 4 mesh spanning both processes, print the tokens as JSON."""
import json
import sys

import jax

jax.config.update("jax_platforms", "cpu")

import jaxspec  # noqa: E402
import jaxspec.distributed  # noqa: E402

if __name__ == "__main__":
    port, pid = sys.argv[1], int(sys.argv[2])
    jaxspec.distributed.initialize(f"localhost:{port}", 2, pid, local_device_count=4)
    from test_distributed import run  # noqa: E402  (imported after the runtime starts)

    print("TOKENS " + json.dumps(run()), flush=True)
    jaxspec.distributed.shutdown()
