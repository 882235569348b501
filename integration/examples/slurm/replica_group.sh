#!/usr/bin/env bash
# One replica group of a multi-host ttnpu-train job, under torchrun's elastic agent (a dead
# process is restarted into the same run folder and heals from a live group). slurm.sbatch runs
# it once per node through srun; any scheduler can run it once per group.
#
#   TORCHFT_LIGHTHOUSE  http://host:port of the job's one torchft_lighthouse    (required)
#   RUN                 the run folder, on storage every node sees                (required)
#   REPLICA_ID          this group's id       (default: SLURM_PROCID)
#   REPLICAS            number of groups      (default: SLURM_NTASKS)
#   MIN_REPLICAS        fewest groups a step commits with (default 1)
#   NPROC               ranks in this group   (default 1)
#   MAX_RESTARTS        torchelastic restarts of a dead group (default 3)
#   REPLICA_HOST        the address the other groups reach this one at (default: its host name)
# Further arguments are ttnpu-train options (e.g. --config dsv4_flash_ft --training.steps 1000).
set -euo pipefail
: "${TORCHFT_LIGHTHOUSE:?set TORCHFT_LIGHTHOUSE to the Lighthouse address}" "${RUN:?set RUN}"
REPLICA_ID=${REPLICA_ID:-${SLURM_PROCID:?set REPLICA_ID or run under srun}}
REPLICAS=${REPLICAS:-${SLURM_NTASKS:?set REPLICAS or run under srun}}
host=()
if [[ -n ${REPLICA_HOST:-} ]]; then host=(--fault_tolerance.host "$REPLICA_HOST"); fi
exec python -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-1}" \
    --max-restarts "${MAX_RESTARTS:-3}" --monitor-interval 0.5 \
    -m ttnpu.trainer.cli --dump_folder "$RUN" --run-name "replica_$REPLICA_ID" \
    --fault_tolerance.enable --fault_tolerance.replica_id "$REPLICA_ID" \
    --fault_tolerance.group_size "$REPLICAS" --fault_tolerance.min_replica_size "${MIN_REPLICAS:-1}" \
    --fault_tolerance.lighthouse "$TORCHFT_LIGHTHOUSE" --fault_tolerance.start_barrier "$RUN/.start" \
    "${host[@]}" "$@"
