"""Admission at scale (requests/s admitted while thousands of streams run): csmserve/apps/bench/admission.py.

python bench/admission.py --model dummy --streams 2000 --rate 1000 --seconds 8"""
import sys

from csmserve.apps.bench.admission import main

if __name__ == "__main__":
    sys.exit(main())
