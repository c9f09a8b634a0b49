#!/usr/bin/env bash
# A real single-node SLURM cluster on 127.0.0.1, for development and CI: munge, MariaDB + slurmdbd (accounting, which
# submitit's `sacct` polling needs), slurmctld and slurmd. Needs root (the daemons run as root; packages from apt).
#
#   launchers/slurm/cluster.sh start    # install what is missing, write configs, start the daemons, wait for the node
#   launchers/slurm/cluster.sh stop     # cancel every job, stop the daemons (state stays in $PRIMERL_SLURM_DIR)
#   launchers/slurm/cluster.sh status   # sinfo + squeue
#   launchers/slurm/cluster.sh lose-node I      # node I lost whole (multi-node only): its link cut, every process in it
#                                               # killed -9, slurmd included; slurmctld notices after SlurmdTimeout
#   launchers/slurm/cluster.sh restore-node I   # its link back and its slurmd started: it returns to service
#   eval "$(launchers/slurm/cluster.sh env)"   # SLURM_CONF for sbatch/squeue/sacct in this shell
#
# Everything lives in $PRIMERL_SLURM_DIR (default /tmp/primerl-slurm). Clients find the cluster through SLURM_CONF.
# Ports: slurmctld 6817, slurmd 6818, slurmdbd 6819, MariaDB 3307, all on 127.0.0.1.
#
# PRIMERL_SLURM_NODES=N (N > 1): N nodes node1..nodeN, each slurmd in its own network namespace (primerl-node<i>)
# with its own address 10.77.0.<10+i> on a bridge (primerl-br0; this side 10.77.0.254). slurmctld, slurmdbd and
# MariaDB run in a namespace of their own (primerl-ctl, 10.77.0.1): slurmctld binds the address its host name resolves
# to, which must be on the bridge, and the host's own resolver is not changed. Nothing but loopback and these
# namespaces is used. A namespace's processes see /etc/netns/<namespace>/hosts as /etc/hosts (bind-mounted in a mount
# namespace of their own): every node name, and this machine's host name as that namespace's own address (what slurmctld binds and gloo
# resolves). Without PRIMERL_SLURM_NODES, /etc is not touched.
set -euo pipefail

DIR=${PRIMERL_SLURM_DIR:-/tmp/primerl-slurm}
CLUSTER=primerl
DB_PORT=3307
NODE_CPUS=${PRIMERL_SLURM_CPUS:-16}
NODES=${PRIMERL_SLURM_NODES:-1}
BRIDGE=primerl-br0
SUBNET=10.77.0
if [ "$NODES" -gt 1 ]; then
  CTLD_ADDR=$SUBNET.1
  CTL=(in_ns primerl-ctl)  # the controller's daemons run in its namespace
else
  CTLD_ADDR=127.0.0.1
  CTL=()
fi
export SLURM_CONF=$DIR/etc/slurm.conf
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server-core)

log() { echo "slurm-cluster: $*" >&2; }
trap 'log "failed at line $LINENO: $BASH_COMMAND (logs in $DIR/log)"' ERR

install_packages() {
  local missing=()
  for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return
  [ "$(id -u)" -eq 0 ] || { log "needs root to install ${missing[*]}"; exit 1; }
  log "installing ${missing[*]} (apt, about 30 s)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >"$DIR/log/apt.log" 2>&1 \
    || { apt-get update -q >>"$DIR/log/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
         "${missing[@]}" >>"$DIR/log/apt.log" 2>&1; } || { log "apt failed; see $DIR/log/apt.log"; exit 1; }
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local seconds=$1 what=$2; shift 2
  for _ in $(seq $((seconds * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "$what did not come up in ${seconds}s; logs in $DIR/log"; exit 1
}

node_lines() {  # the NodeName lines of slurm.conf, and where each slurmd keeps its files
  local memory=$1
  if [ "$NODES" -eq 1 ]; then
    echo "SlurmdSpoolDir=$DIR/spool"
    echo "SlurmdPidFile=$DIR/run/slurmd.pid"
    echo "SlurmdLogFile=$DIR/log/slurmd.log"
    echo "NodeName=$(hostname) NodeAddr=127.0.0.1 CPUs=$NODE_CPUS RealMemory=$memory State=UNKNOWN"
    return
  fi
  echo "SlurmdSpoolDir=$DIR/spool/%n"
  echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
  echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
  for i in $(seq "$NODES"); do
    echo "NodeName=node$i NodeAddr=$SUBNET.$((10 + i)) CPUs=$NODE_CPUS RealMemory=$((memory / NODES)) State=UNKNOWN"
  done
}

net_up() {  # the bridge, a namespace per node (and the controller's) with a veth on it, and their hosts files
  ip link show $BRIDGE >/dev/null 2>&1 || ip link add $BRIDGE type bridge
  ip addr replace $SUBNET.254/24 dev $BRIDGE
  ip link set $BRIDGE up
  local name address
  for i in ctl $(seq "$NODES"); do
    if [ "$i" = ctl ]; then name=primerl-ctl address=$SUBNET.1; else name=primerl-node$i address=$SUBNET.$((10 + i)); fi
    ip netns list | grep -qw "$name" || ip netns add "$name"
    ip link show "veth-$i" >/dev/null 2>&1 || ip link add "veth-$i" type veth peer name eth0 netns "$name"
    ip link set "veth-$i" master $BRIDGE up
    ip -n "$name" addr replace "$address/24" dev eth0
    ip -n "$name" link set eth0 up
    ip -n "$name" link set lo up
    mkdir -p "/etc/netns/$name"
    {
      echo "127.0.0.1 localhost"
      echo "$address $(hostname)"
      for j in $(seq "$NODES"); do echo "$SUBNET.$((10 + j)) node$j"; done
    } >"/etc/netns/$name/hosts"
  done
}

net_down() {
  for i in ctl $(seq "$NODES"); do
    local name=primerl-node$i
    [ "$i" = ctl ] && name=primerl-ctl
    ip link del "veth-$i" 2>/dev/null || true
    ip netns del "$name" 2>/dev/null || true
    rm -rf "/etc/netns/$name"
  done
  ip link del $BRIDGE 2>/dev/null || true
}

in_ns() {  # in_ns NAMESPACE COMMAND...: in its network, with its hosts file as /etc/hosts. Not `ip netns exec`, whose
  # fresh /sys has no cgroup mount, which slurmd needs.
  local name=$1; shift
  nsenter --net="/run/netns/$name" unshare --mount --propagation private \
    bash -c 'mount --bind "$0" /etc/hosts && exec "$@"' "/etc/netns/$name/hosts" "$@"
}

start_slurmd() {
  if [ "$NODES" -eq 1 ]; then slurmd; return; fi
  for i in $(seq "$NODES"); do
    mkdir -p "$DIR/spool/node$i"
    in_ns "primerl-node$i" slurmd -N "node$i"
  done
}

write_configs() {
  local memory
  memory=$(slurmd -C | head -n 1 | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  cat >"$DIR/etc/slurm.conf" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$(hostname)($CTLD_ADDR)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=10
# A node that stops answering is DOWN after this long (default 300 s), and its jobs are requeued elsewhere
SlurmdTimeout=30
# A requeued job waits cred_expire seconds (default 120) before it may start, and pending jobs are looked at every
# sched_interval seconds (default 60): a development cluster wants both short.
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=2,bf_interval=2
MinJobAge=600
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTLD_ADDR
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/none
# The node claims $NODE_CPUS CPUs whatever it has (config_overrides): a run's 3 jobs must fit at once even on 2 cores.
SlurmdParameters=config_overrides
$(node_lines "$memory")
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=$CTLD_ADDR
DbdPort=6819
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=root
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"  # slurmdbd refuses a readable config
}

start_munge() {
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    [ -s /etc/munge/munge.key ] || { mungekey --create >/dev/null 2>&1 || /usr/sbin/create-munge-key -f; }
    runuser -u munge -- /usr/sbin/munged
  fi
  wait_for 10 munged bash -c 'munge -n | unmunge'
}

start_mariadb() {
  # accounting for a throwaway loopback cluster: no grant tables (so no system tables to install), 127.0.0.1 only
  mkdir -p "$DIR/mysql"
  "${CTL[@]}" mariadbd --user=root --datadir="$DIR/mysql" --socket="$DIR/run/mysqld.sock" --pid-file="$DIR/run/mariadb.pid" \
    --bind-address=127.0.0.1 --port=$DB_PORT --skip-grant-tables --log-error="$DIR/log/mariadb.log" \
    </dev/null >>"$DIR/log/mariadb.log" 2>&1 &
  wait_for 30 MariaDB "${CTL[@]}" bash -c "exec 3<>/dev/tcp/127.0.0.1/$DB_PORT"
}

# nodes that answer and take jobs, busy or not: a cluster whose nodes run jobs is running (a restart would lose them)
up_nodes() { sinfo -h -N --responding -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated|completing)$' || true; }

start() {
  mkdir -p "$DIR"/{etc,state,spool,run,log}
  install_packages
  if [ "$(up_nodes)" -eq "$NODES" ]; then
    log "already running ($SLURM_CONF)"; return
  fi
  write_configs
  [ "$NODES" -eq 1 ] || net_up
  start_munge
  start_mariadb
  "${CTL[@]}" slurmdbd  # reads slurmdbd.conf beside $SLURM_CONF
  wait_for 30 slurmdbd bash -c "exec 3<>/dev/tcp/$CTLD_ADDR/6819"
  sacctmgr -i add cluster $CLUSTER >/dev/null 2>&1 || true
  "${CTL[@]}" slurmctld -c  # -c: start clean, forgetting jobs of an earlier cluster in this directory
  wait_for 30 slurmctld scontrol ping
  start_slurmd
  wait_for 60 "the nodes" bash -c "[ \$(sinfo -h -N -o %T | grep -c idle) -eq $NODES ]"
  log "up: $(sinfo -h -o '%P %D %T %c CPUs %N')  (export SLURM_CONF=$SLURM_CONF)"
}

lose_node() {  # lose_node I: what a node that loses power does to the cluster, on node I's namespace
  local name=primerl-node$1
  [ "$NODES" -gt 1 ] && ip netns list | grep -qw "$name" || { log "no node $1 to lose"; exit 2; }
  ip link set "veth-$1" down
  ip netns pids "$name" | xargs -r kill -9
  rm -f "$DIR/run/slurmd-node$1.pid"
  log "node$1 lost: its link is down and its processes are killed"
}

restore_node() {  # restore_node I: node I's link back and its slurmd started (ReturnToService=2 takes it back)
  [ "$NODES" -gt 1 ] || { log "no node $1 to restore"; exit 2; }
  ip link set "veth-$1" up
  in_ns "primerl-node$1" slurmd -N "node$1"
  wait_for 60 "node$1" bash -c "sinfo -h -n node$1 --responding -o %T | grep -qE '^(idle|mixed|allocated)$'"
  log "node$1 restored"
}

stop_pidfile() {
  local pidfile=$DIR/run/$1.pid
  [ -f "$pidfile" ] || return 0
  local pid; pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

stop() {
  if [ -f "$SLURM_CONF" ]; then scancel --full --quiet --user="$(id -un)" 2>/dev/null || true; fi
  for daemon in slurmd $(seq -f slurmd-node%g "$NODES") slurmctld slurmdbd mariadb; do stop_pidfile "$daemon"; done
  [ "$NODES" -eq 1 ] || net_down
  log "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo; squeue ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  lose-node) lose_node "${2:?node index}" ;;
  restore-node) restore_node "${2:?node index}" ;;
  *) echo "usage: $0 start|stop|status|env|lose-node I|restore-node I" >&2; exit 2 ;;
esac
