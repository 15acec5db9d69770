#!/bin/bash
# SLURM epilog: remove the grpo-exporter target files that no exporter touches any more (guide:
# deploy/slurm/README.md). Install on every compute node and name it in slurm.conf:
#
#   Epilog=/etc/slurm/epilog.d/grpo-exporter.sh
#
# It runs as root (or SlurmUser) after each job on each of its nodes and removes every grpo-*.json that the
# exporter wrote and nobody touched for --stale-after-s (default 3600 s, the exporter's targets_stale_after_s): a
# serving exporter touches its file every minute, so only a dead job's file gets that old. Files of other programs
# are left alone. Give --stale-after-s here if your jobs set another GRPO_EXPORTER_TARGETS_STALE_AFTER_S.
#
# Why not remove the file of the job that just ended, here and now: a job that ended normally (close()) has
# removed its own file already, after Prometheus scraped its end. A file still there belongs to a job that did
# not end normally (killed, out of memory, a node failure, scancel without a SIGTERM handler): it keeps
# Prometheus scraping the dead target, and that failed scrape is what pages GRPOExporterDown. Removed at once,
# the target would vanish with the job and the crash would page nothing until GRPOTrainingStalled, much later.
# So the file goes only once it is stale, an hour after the crash: by then the page has been sent and seen.
#
# An epilog must never fail: a non-zero exit drains the node. Every failure (the shared filesystem not mounted
# or hung, grpo-exporter missing) is logged (syslog, tag grpo-exporter-epilog) and the epilog exits 0; a hung
# NFS mount is cut off after 60 s.

TARGETS_DIR=${EPILOG_TARGETS_DIR:-/shared/prometheus/targets}
# the grpo-exporter command of the training environment every node sees (it imports torch: a few seconds)
GRPO_EXPORTER=${EPILOG_GRPO_EXPORTER:-/shared/envs/train/bin/grpo-exporter}

if ! output=$(timeout -k 5 60 "$GRPO_EXPORTER" targets prune --dir "$TARGETS_DIR" 2>&1); then
    logger -t grpo-exporter-epilog "targets prune in $TARGETS_DIR failed (job ${SLURM_JOB_ID:-?}): $(tail -n 3 <<<"$output")" || true
elif [ -n "$output" ]; then
    logger -t grpo-exporter-epilog "$output" || true
fi
exit 0
