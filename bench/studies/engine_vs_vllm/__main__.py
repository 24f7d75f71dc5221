import sys

from pagedbench.bench.studies.engine_vs_vllm.study import main

main(sys.argv[1:])
