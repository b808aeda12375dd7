#!/usr/bin/env bash
# Start a real Slurm cluster on this machine, for development and tests.
#
# Debian's slurm-wlm 22.05 with munge and accounting (slurmdbd + MariaDB: submitit
# learns job states only from sacct), started by hand, without systemd. All state
# (munge key and socket, database, configs, spool, logs, pid files) lives in one
# directory, so nothing under /etc is touched and stopping the cluster ends only
# what this script started. Installs the packages with apt-get when missing. Run as root.
#
# Usage: slurm/dev-cluster-start.sh [--nodes N]
#   --nodes N                emulated nodes (one slurmd each, all on this machine); default 1
# Environment:
#   TIDERL_SLURM_DIR         state directory (default /tmp/tiderl-slurm)
#   TIDERL_SLURM_NODES       same as --nodes
#   TIDERL_SLURM_PORT_BASE   first of the TCP ports used (default 6817): slurmctld, slurmdbd,
#                            MariaDB, then one per slurmd
#
# Idempotent: with the cluster already up it changes nothing and succeeds. Otherwise it
# starts a clean cluster: the job and node state and the accounting database of an earlier
# one are dropped, so jobs of a cluster that was killed cannot hold its nodes. It prints
# the line every Slurm client (sbatch, sacct, submitit) needs:
#   export SLURM_CONF=$TIDERL_SLURM_DIR/etc/slurm.conf
# Stop with slurm/dev-cluster-stop.sh (same TIDERL_SLURM_DIR).
set -euo pipefail

DIR=${TIDERL_SLURM_DIR:-/tmp/tiderl-slurm}
NUM_NODES=${TIDERL_SLURM_NODES:-1}
PORT_BASE=${TIDERL_SLURM_PORT_BASE:-6817}
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NUM_NODES=${2:?--nodes needs a number}; shift 2 ;;
    --nodes=*) NUM_NODES=${1#--nodes=}; shift ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "dev-cluster-start: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$NUM_NODES" in
  ''|*[!0-9]*|0) echo "dev-cluster-start: --nodes must be a positive integer, got '$NUM_NODES'" >&2; exit 2 ;;
esac
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

ETC=$DIR/etc RUN=$DIR/run LOG=$DIR/log
MUNGE_SOCKET=$DIR/munge/munge.socket
CTLD_PORT=$PORT_BASE DBD_PORT=$((PORT_BASE + 2)) DB_PORT=$((PORT_BASE + 3)) SLURMD_PORT0=$((PORT_BASE + 4))
export SLURM_CONF=$ETC/slurm.conf
DB_PASS=tiderl-dev

log() { echo "dev-cluster-start: $*" >&2; }
die() {
  local f
  log "error: $*"
  for f in "$LOG"/*.log; do
    if [ -s "$f" ]; then echo "--- tail $f" >&2; tail -n 15 "$f" >&2; fi
  done
  # A half-started cluster would pass for one that is up at the next start: stop it.
  TIDERL_SLURM_DIR=$DIR bash "$(dirname "$0")/dev-cluster-stop.sh" >/dev/null 2>&1 || true
  exit 1
}

# A daemon counts as ours only when its pid file names a live process of that program.
is_running() {  # pidfile program
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]
}

wait_for() {  # seconds description command...
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "timed out waiting for $what"
    sleep 0.1
  done
}

node_names() { local i; for i in $(seq 1 "$NUM_NODES"); do echo "dev$i"; done; }

all_up() {
  [ -f "$ETC/slurm.conf" ] || return 1
  # A cluster started with another node count is not the one asked for.
  [ "$(cat "$ETC/num_nodes" 2>/dev/null)" = "$NUM_NODES" ] || return 1
  is_running "$RUN/munged.pid" munged && is_running "$RUN/mariadbd.pid" mariadbd &&
    is_running "$RUN/slurmdbd.pid" slurmdbd && is_running "$RUN/slurmctld.pid" slurmctld || return 1
  local n
  for n in $(node_names); do is_running "$RUN/slurmd-$n.pid" slurmd || return 1; done
  sinfo -h -o %t >/dev/null 2>&1
}

if [ "$(id -u)" != 0 ]; then
  # slurmd starts job tasks as their users and the packages install with apt-get: both need root.
  log "error: run as root (slurmd and apt-get need it)"
  exit 1
fi

if all_up; then
  log "already running in $DIR"
  echo "export SLURM_CONF=$SLURM_CONF"
  exit 0
fi

# --- install -----------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v slurmdbd >/dev/null ||
   ! command -v munged >/dev/null || ! command -v mariadbd >/dev/null || ! command -v sbatch >/dev/null; then
  log "installing slurm-wlm, slurmdbd, munge, mariadb-server with apt-get"
  # Package scripts must not start system-wide daemons: a policy-rc.d that refuses does that.
  added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && added_policy=1
  fi
  apt_status=0
  { apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurm-wlm slurmdbd munge mariadb-server mariadb-client >/dev/null; } || apt_status=$?
  if [ "$added_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  [ "$apt_status" = 0 ] || { log "error: apt-get failed (exit $apt_status)"; exit 1; }
fi

# Leftovers of a cluster that is partly up (or was started with another node count) go first.
TIDERL_SLURM_DIR=$DIR bash "$(dirname "$0")/dev-cluster-stop.sh" >/dev/null 2>&1 || true

# A clean cluster: a killed one's saved jobs would be recovered and hold the nodes (they are
# never idle again until slurmctld gives up on them), and its accounting would repeat job ids.
rm -rf "$DIR/state" "$DIR/spool" "$DIR/db"
mkdir -p "$ETC" "$RUN" "$LOG" "$DIR/munge" "$DIR/state" "$DIR/spool"
chmod 700 "$DIR/munge"
HOST=$(hostname -s)

# --- munge -------------------------------------------------------------------------
if [ ! -s "$DIR/munge/munge.key" ]; then
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$DIR/munge/munge.key"
fi
# --force: the state directory may sit below a world-writable /tmp, which munged otherwise refuses.
munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" \
  --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" --seed-file="$DIR/munge/munged.seed"
wait_for 10 munged test -S "$MUNGE_SOCKET"

# --- MariaDB (accounting database) ---------------------------------------------------
DB_SOCKET=$DIR/mysql.sock
start_db() {
  # setsid: a daemon of its own session, not ended with the shell or process group that ran this script.
  setsid mariadbd --no-defaults --user=root --datadir="$DIR/db" --socket="$DB_SOCKET" \
    --pid-file="$RUN/mariadbd.pid" --log-error="$LOG/mariadbd.log" \
    --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
    --innodb-buffer-pool-size=32M --innodb-log-file-size=16M --skip-log-bin \
    --innodb-flush-log-at-trx-commit=0 --innodb-flush-method=nosync --innodb-doublewrite=0 \
    --innodb-lock-wait-timeout=900 >/dev/null 2>&1 &
  wait_for 30 "mariadbd" mariadb --no-defaults -S "$DB_SOCKET" -u root -e "SELECT 1"
}
if [ ! -d "$DIR/db/mysql" ]; then
  rm -rf "$DIR/db"
  mariadb-install-db --no-defaults --user=root --datadir="$DIR/db" --auth-root-authentication-method=normal \
    --skip-test-db >"$LOG/mariadb-install-db.log" 2>&1 || die "mariadb-install-db failed"
  start_db
  mariadb --no-defaults -S "$DB_SOCKET" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
else
  start_db
fi

# --- configs ---------------------------------------------------------------------------
# The node line comes from what slurmd sees on this machine, renamed per emulated node.
NODE_HW=$(slurmd -C | head -n 1 | sed -E 's/^NodeName=[^ ]+ //')
{
  cat <<EOF
# Generated by slurm/dev-cluster-start.sh: a single-machine development cluster.
ClusterName=tiderl-dev
# The address is given so nothing depends on name resolution of this host.
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=30
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
# No cgroups here.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# With a custom munge socket, slurmctld reaches slurmdbd through this socket.
AccountingStoragePass=$MUNGE_SOCKET
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
# Short waits keep tests quick: cancelled steps are killed after KillWait seconds.
KillWait=5
MinJobAge=300
# sched_interval: a requeued job whose hold (cred_expire) ran out starts within seconds, not a minute.
SchedulerParameters=batch_sched_delay=0,sched_interval=5
MessageTimeout=10
MailProg=/bin/true
EOF
  i=0
  for n in $(node_names); do
    echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT0 + i)) $NODE_HW State=UNKNOWN"
    i=$((i + 1))
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} > "$ETC/slurm.conf"
echo "$NUM_NODES" > "$ETC/num_nodes"

cat > "$ETC/slurmdbd.conf" <<EOF
# Generated by slurm/dev-cluster-start.sh.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
chmod 600 "$ETC/slurmdbd.conf"

# --- Slurm daemons -------------------------------------------------------------------
slurmdbd || die "slurmdbd did not start"
wait_for 30 "slurmdbd" sacctmgr -n -i list cluster
slurmctld -i || die "slurmctld did not start"
wait_for 30 "slurmctld" scontrol ping
for n in $(node_names); do
  mkdir -p "$DIR/spool/$n"
  slurmd -N "$n" || die "slurmd $n did not start"
done
nodes_idle() { [ "$(sinfo -h -N -t idle -o %N | sort -u | wc -l)" -eq "$NUM_NODES" ]; }
wait_for 60 "$NUM_NODES idle node(s)" nodes_idle

log "up in $DIR ($NUM_NODES node(s), logs in $LOG)"
echo "export SLURM_CONF=$SLURM_CONF"
