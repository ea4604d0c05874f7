"""Host work per engine step with a stand-in runner (CPU): python bench/host_step.py --rows 64,512,2048
The code is csmserve/bench_host.py."""
import sys

from csmserve.bench_host import main

if __name__ == "__main__":
    sys.exit(main())
