#!/usr/bin/env bash
# Stop the development Slurm cluster that slurm/dev-cluster-start.sh started.
#
# Cancels the cluster's jobs, then ends only the daemons named in its pid files
# (checking that each pid is still that program): slurmd, slurmctld, slurmdbd,
# MariaDB, munge. Then ends what a killed cluster leaves behind: slurmstepd and
# job processes whose environment names this cluster's slurm.conf. Succeeds when
# nothing runs.
#
# Usage: slurm/dev-cluster-stop.sh [--purge]
#   --purge            also delete the state directory (database, job state, logs)
# Environment:
#   TIDERL_SLURM_DIR   state directory (default /tmp/tiderl-slurm)
set -euo pipefail

DIR=${TIDERL_SLURM_DIR:-/tmp/tiderl-slurm}
PURGE=0
case "${1:-}" in
  --purge) PURGE=1 ;;
  "") ;;
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "dev-cluster-stop: unknown argument: $1 (see --help)" >&2; exit 2 ;;
esac
RUN=$DIR/run

# Gone, or a zombie waiting for its reaper (which may be slow in a container): either way stopped.
is_alive() {  # pid
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}

stop_pidfile() {  # pidfile program
  local pidfile=$1 program=$2 pid i
  [ -s "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  # A pid file may outlive its daemon and the pid be reused: only that program is ours.
  if [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$program" ]; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do
      is_alive "$pid" || break
      sleep 0.1
    done
    if is_alive "$pid"; then
      echo "dev-cluster-stop: $program ($pid) ignored SIGTERM for 10 s: SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
    echo "dev-cluster-stop: stopped $program ($pid)" >&2
  fi
  rm -f "$pidfile"
}

# Jobs first: their processes (slurmstepd and the tasks) outlive slurmd and would linger.
cancel_jobs() {
  local conf=$DIR/etc/slurm.conf jobs i
  [ -f "$conf" ] && [ -s "$RUN/slurmctld.pid" ] || return 0
  jobs=$(SLURM_CONF=$conf timeout 10 squeue -h -o %i 2>/dev/null) || return 0
  [ -n "$jobs" ] || return 0
  # shellcheck disable=SC2086
  SLURM_CONF=$conf scancel $jobs 2>/dev/null || true
  for i in $(seq 1 150); do
    [ -z "$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null)" ] && break
    sleep 0.1
  done
  echo "dev-cluster-stop: cancelled jobs $(echo $jobs)" >&2
}

if [ -d "$RUN" ]; then
  cancel_jobs
  for pidfile in "$RUN"/slurmd-*.pid; do
    [ -e "$pidfile" ] && stop_pidfile "$pidfile" slurmd
  done
  stop_pidfile "$RUN/slurmctld.pid" slurmctld
  stop_pidfile "$RUN/slurmdbd.pid" slurmdbd
  stop_pidfile "$RUN/mariadbd.pid" mariadbd
  stop_pidfile "$RUN/munged.pid" munged
fi
# A cluster whose daemons were killed (not stopped) leaves its jobs' processes running:
# slurmstepd and the tasks. Ours are the ones whose environment names our slurm.conf.
sweep_job_processes() {
  local conf=$DIR/etc/slurm.conf env p comm swept=""
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" != $$ ] || continue
    env=$( { tr '\0' '\n' < "/proc/$p/environ"; } 2>/dev/null) || continue
    grep -qxF "SLURM_CONF=$conf" <<<"$env" || continue
    comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
    if [ "$comm" = slurmstepd ] || grep -q '^SLURM_JOB_ID=' <<<"$env"; then
      kill -KILL "$p" 2>/dev/null && swept="$swept $p"
    fi
  done
  if [ -n "$swept" ]; then echo "dev-cluster-stop: ended leftover job processes$swept" >&2; fi
}
sweep_job_processes

if [ "$PURGE" = 1 ]; then
  rm -rf "$DIR"
  echo "dev-cluster-stop: removed $DIR" >&2
fi
