"""A Ray job that fails on the last rank's node (tests of failure forensics): a task pinned
there prints the secret FX_SECRET (which no bundle may hold), prints a traceback and exits
its worker process; the driver then fails with Ray's WorkerCrashedError. With an argument
FILE, it first creates FILE (a test service waits for it to die)."""

import os
import sys
import traceback

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

if len(sys.argv) > 1:
    open(sys.argv[1], "w").close()
ray.init()


@ray.remote(num_cpus=0)
def rank():
    return int(os.environ["RLHF_TASKS_NODE_RANK"]), ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0, max_retries=0)
def shard():
    print("shard with key", os.environ.get("FX_SECRET"), flush=True)
    try:
        raise RuntimeError("bad shard on rank %s" % os.environ["RLHF_TASKS_NODE_RANK"])
    except RuntimeError:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
ranks = dict(ray.get([rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                      for n in nodes]))
print("ranks", sorted(ranks), flush=True)
ray.get(shard.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ranks[max(ranks)], soft=False)).remote())
