"""python -m engine.bench [serve] ...: the offline bench, or the online one with `serve`."""

import sys

if sys.argv[1:2] == ["serve"]:
    from engine.bench.serve import main

    sys.exit(main(sys.argv[2:]))
from engine.bench.offline import main

sys.exit(main())
