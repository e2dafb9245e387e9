"""`python -m edgekv.native` (make native): build edgekv's int8 kernel library for this machine, if not built yet.
Without a C++ compiler it says so in one line and exits 0: only `export --pte-kernel edgekv` needs the library."""
import sys

from ..errors import EdgekvError
from . import build, compiler


def main() -> int:
    if compiler() is None:
        print("native: no C++ compiler (g++): export --pte-kernel edgekv is unavailable; the default "
              "(--pte-kernel executorch) needs nothing built")
        return 0
    try:
        print(f"native: {build()}")
    except EdgekvError as e:
        print(f"native: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
