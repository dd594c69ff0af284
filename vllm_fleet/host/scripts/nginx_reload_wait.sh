# nginx_reload_wait.sh: remember nginx's worker PIDs, reload, wait until they have all exited
# (the rollout role's drain of the proxy). Run as root:
#     bash -c "$(cat nginx_reload_wait.sh)" nginx-reload-wait TIMEOUT_S INTERVAL_S
# Prints `drained <seconds>` or `timeout <seconds> <pids left>`; fails when `nginx -t` does
# (nothing reloaded then).
set -e
timeout=$1 interval=$2
nginx -t -q
master=$(cat /run/nginx.pid)
old=$(pgrep -P "$master" | tr '\n' ' ')
systemctl reload nginx
start=$(date +%s.%N)
while :; do
  left=""
  for p in $old; do [ -d /proc/$p ] && left="$left $p"; done
  now=$(date +%s.%N)
  el=$(echo "$now - $start" | awk '{print $1 - $3}')
  if [ -z "$left" ]; then echo "drained $el"; exit 0; fi
  if awk -v e="$el" -v t="$timeout" 'BEGIN {exit !(e >= t)}'; then echo "timeout $el$left"; exit 0; fi
  sleep "$interval"
done
