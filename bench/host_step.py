"""Host work per engine step with a stand-in runner (CPU): python bench/host_step.py --rows 64,512,2048
The code is csmserve/apps/bench/host_step.py."""
import sys

from csmserve.apps.bench.host_step import main

if __name__ == "__main__":
    sys.exit(main())
