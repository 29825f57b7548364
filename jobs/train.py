"""Entry point for `ray job submit`: the same training as `ray-diloco train`, on the job's Ray cluster.

    ray job submit --working-dir . --runtime-env jobs/runtime_env.yaml -- python jobs/train.py --regions 2

Inside a job, RAY_ADDRESS points at the cluster, so the driver connects to it instead of starting one.
"""

import sys

from ray_diloco.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
