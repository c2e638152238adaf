"""`python -m checkpoints_convert SRC OUT [--dtype float32|bfloat16] [--quantize int8|int4|native] [--force]`:
one `error: ...` line and exit status 2 for any input it cannot convert (nothing is left behind); a progress
bar on stderr otherwise. SIGINT / SIGTERM stop it at the next tensor (one `error: interrupted` line, exit status
130 / 143, nothing left behind); a second one ends it at once."""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from checkpoints_convert.convert import ConvertError, Interrupted, convert, stop_on_signals
from jaxspec.checkpoint import WeightsError
from jaxspec.checkpoint.orbax import read_dtype
from jaxspec.config import ConfigError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoints_convert", description=__doc__.split(":")[0])
    p.add_argument("src", metavar="SRC", help="HF model directory (safetensors, sharded or not) or a .gguf file")
    p.add_argument("out", metavar="OUT", help="the converted model directory to create")
    p.add_argument("--dtype", default=None, help="parameter dtype: float32 or bfloat16 (default: the source's, "
                   "bfloat16 if all its float tensors are, else float32; float32 for a GGUF)")
    p.add_argument("--quantize", default=None, help="keep weights packed as jaxspec.load(SRC, quantize=...) does: "
                   "int8, int4 or native (a GGUF's Q4_0/Q4_1/Q8_0, a compressed-tensors INT4 checkpoint's own packing)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax logs its deprecations at WARNING
    try:
        with stop_on_signals():  # recorded, acted on between tensors; the temporary folder is removed
            out = convert(args.src, args.out, args.dtype, quantize=args.quantize, force=args.force,
                          progress=not args.quiet)
    except Interrupted as e:
        print(f"error: interrupted by {signal.Signals(e.signum).name}; {args.out} was not written", file=sys.stderr)
        return 128 + e.signum
    except (ConvertError, ConfigError, WeightsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({read_dtype(out)} parameters); "
          f"load it with jaxspec.load({str(out)!r}, mesh=jaxspec.make_mesh(tp=...))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
