"""The node agent: runs on every node of the cluster and turns it into a Ray node.

Standard library only and Python >= 3.8, so it can be shipped into any training image as
plain files beside the plan (`lib/rlhf_tasks/__init__.py` and `lib/rlhf_tasks/agent/**/*.py`;
rlhf-tasks itself is not installed on the nodes) and started by its entry file's path,
`python3 lib/rlhf_tasks/agent/__main__.py --plan plan.json` (never `-m`, which would put the
working directory, and any rlhf_tasks package there, first on sys.path). It knows no
provider: the plan carries the provider's environment contract as data, and the agent
only interprets it. Then:

  head (rank 0): prepare data, `ray start --head` on the private address, open the ready
                 beacon once its GCS serves; once its dashboard answers, submit
                 (job.submit: head) the job behind a gate that runs preflight first (else
                 preflight as a job of its own), so that both start up while the workers
                 join; start the services and wait until they answer, wait until every
                 node is ALIVE and preflight passed, then open the gate,
                 follow the job (restarting it by its restart policy), exit with its result.
  worker:        wait for the head's ready beacon, `ray start --address`, start the
                 every-node services, supervise the raylet until the head goes away.
  every_node:    (torchrun and the like) no Ray: every node runs the job's command itself.

Every step prints one timestamped line; the agent ends with one structured result line
that the launcher reads. Secrets are passed by variable name and never printed. No fixed
sleeps: every wait polls its condition against a deadline.

Modules: protocol (a package: what the launcher and the agent both speak, and its bundle, a
failure's logs of every node gathered into one .tar.gz, which the head and the launcher both
make; the only part code outside this package imports), forensics (a node keeping its
evidence where Ray's log API reads it, the head's gathering when the run fails), contract
(the provider's contract, addresses), processes (children and process groups), raynode
(Ray's start command and environment, the Node), limits (the open-files limit the job needs,
raised before anything starts), beacon (the head's ready beacon), head (the
head's bring-up), jobrunner (submitting, following and restarting the job), worker (workers
and every_node mode), probe and preflight (preflight's driver: in the job's gate, or a Ray
job of its own), attached (the roles where someone else starts Ray, as KubeRay does: prepare
before it, a node's services and environment before its `ray start`, the head's flow once it
is up), __main__ (the entry point).
"""
