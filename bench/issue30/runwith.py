"""mergepipe CLI with the bf16 kernels from $KLIB (a .so built from some _bf16c.c), for A/B runs."""
import ctypes, os, sys
from mergepipe.methods import _ckernels
if os.environ.get("KLIB"):
    _ckernels._open = lambda: _ckernels._bind(ctypes.CDLL(os.environ["KLIB"]), "ab")
from mergepipe.cli import main
sys.exit(main(sys.argv[1:]))
