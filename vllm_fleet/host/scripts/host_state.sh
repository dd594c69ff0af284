# host_state.sh: everything a vllm-fleet deploy compares against on one host, in one round trip.
#
# Run by the HostState fact (vllm_fleet/host/state.py) as root, and by `vllm-fleet diff` through the one transport:
#     sh -c "$(cat host_state.sh)" host-state KIND VALUE [KIND VALUE]...
# Prints one tab-separated line per answer, then `end`:
#   stat PATH TYPE USER GROUP MODE SIZE   (TYPE as stat's %F; `stat PATH -` when absent)
#   sha PATH SHA256                       (`-` when not a regular file)
#   read PATH BASE64                      (a small file's content; `-` when absent)
#   ls DIR .  then  ls DIR NAME           (one line per entry; no `.` line when DIR is absent)
#   find DIR .  then  find DIR SIZE RELPATH   (regular files under DIR)
#   tree DIR .  then  tree DIR SIZE MTIME CTIME RELPATH   (regular files under DIR with find's %T@ and
#                                         %C@: seconds.nanoseconds of the last write and of the last
#                                         inode change; the owner of a file can set the first, not the second)
#   user NAME PASSWD-LINE                 (getent passwd; `-` when absent)
#   deb NAME STATUS VERSION               (dpkg-query; packages dpkg does not know print nothing)
#   unit KEY=VALUE / unit (blank)         (systemctl show Id/LoadState/ActiveState/SubState/UnitFileState/NRestarts)
#   started UNIT SECONDS                  (how long ago the unit's main process started; none when it never did)
#   age PATH SECONDS                      (how long ago PATH was last written; `-` when absent)
#   chat PORT CODE BASE64                 (one short chat with a local vLLM, `chat "PORT SECRETS_ENV MODEL TOKENS"`:
#                                          the key read from SECRETS_ENV, given to curl on stdin, never in argv)
#   py PYTHON LINE / py PYTHON .          (an env's probe: `py PYTHON`, `pycode CODE`, `pyargs ARGS`)
#   glob PATTERN .  then  glob PATTERN PATH BASE64   (every regular file a shell glob matches; BASE64 `-`
#                                         for one over 1 MiB: there, its text not sent; a *.service
#                                         one also: globunit PATH ACTIVE ENABLED)
#   free PATH BYTES                       (df's "avail" of PATH's filesystem, or of its nearest existing
#                                          parent when PATH is not there yet; `-` when df gave no figure)
#   target PY machine=M / glibc=V / python=X.Y   (what the host's wheels must fit: uname -m, the C library,
#                                          the system python PY's version; no python= line without PY)
#   gpus FIELDS .  then  gpus FIELDS LINE (nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits, one
#                                          line per GPU, or its message when no driver answers;
#                                          `gpus FIELDS -` alone when the host has no nvidia-smi)
#   gpuapps FIELDS .  then  gpuapps FIELDS LINE   (nvidia-smi --query-compute-apps=FIELDS, one line per
#                                          compute process; `gpuapps FIELDS -` alone without nvidia-smi);
#                                          then gpupid PID MINOR CGROUP COMM for every process holding
#                                          /dev/nvidiaMINOR open (the display server too), CGROUP its
#                                          systemd cgroup path (`-` when unreadable), and gpuminor UUID
#                                          MINOR per GPU (/proc/driver/nvidia/gpus/*/information)
#   pci DIR .  then  pci DIR VENDOR CLASS (every device under a sysfs directory, e.g. /sys/bus/pci/devices,
#                                          read with the shell's own `read`: no process per device)
# Reads only; changes nothing.
set -f
TAB=$(printf '\t')
debs="" units="" py="" code=""
while [ $# -ge 2 ]; do
  k=$1 v=$2
  shift 2
  case $k in
    stat)
      if [ -e "$v" ] || [ -L "$v" ]; then
        printf 'stat\t%s\t%s\n' "$v" "$(stat -c "%F$TAB%U$TAB%G$TAB%a$TAB%s" -- "$v")"
      else
        printf 'stat\t%s\t-\n' "$v"
      fi ;;
    sha)
      if [ -f "$v" ] && s=$(sha256sum -- "$v"); then printf 'sha\t%s\t%s\n' "$v" "${s%% *}"; else printf 'sha\t%s\t-\n' "$v"; fi ;;
    read)
      if [ -f "$v" ]; then printf 'read\t%s\t%s\n' "$v" "$(base64 -w0 -- "$v")"; else printf 'read\t%s\t-\n' "$v"; fi ;;
    ls)
      if [ -d "$v" ]; then
        printf 'ls\t%s\t.\n' "$v"
        ls -1A -- "$v" | while IFS= read -r n; do printf 'ls\t%s\t%s\n' "$v" "$n"; done
      fi ;;
    find)
      if [ -d "$v" ]; then
        printf 'find\t%s\t.\n' "$v"
        find "$v" -type f -printf '%s %P\n' | while IFS= read -r n; do printf 'find\t%s\t%s\n' "$v" "$n"; done
      fi ;;
    tree)
      if [ -d "$v" ]; then
        printf 'tree\t%s\t.\n' "$v"
        find "$v" -type f -printf '%s %T@ %C@ %P\n' | while IFS= read -r n; do printf 'tree\t%s\t%s\n' "$v" "$n"; done
      fi ;;
    glob)
      printf 'glob\t%s\t.\n' "$v"
      set +f
      # shellcheck disable=SC2086  (the pattern is a glob on purpose)
      for f in $v; do
        if [ -f "$f" ]; then
          if [ "$(stat -c %s -- "$f")" -le 1048576 ]; then
            printf 'glob\t%s\t%s\t%s\n' "$v" "$f" "$(base64 -w0 -- "$f")"
          else
            printf 'glob\t%s\t%s\t-\n' "$v" "$f"
          fi
          case $f in
            *.service) if command -v systemctl >/dev/null 2>&1; then
                printf 'globunit\t%s\t%s\t%s\n' "$f" "$(systemctl is-active -- "${f##*/}" 2>/dev/null)" "$(systemctl is-enabled -- "${f##*/}" 2>/dev/null)"
              fi ;;
          esac
        fi
      done
      set -f ;;
    age)
      if m=$(stat -c %Y -- "$v" 2>/dev/null); then printf 'age\t%s\t%s\n' "$v" "$(( $(date +%s) - m ))"; else printf 'age\t%s\t-\n' "$v"; fi ;;
    chat)
      IFS=' ' read -r cport csec cmodel ctok <<CHAT_ARGS
$v
CHAT_ARGS
      ckey=$(sed -n 's/^VLLM_API_KEY=//p' "$csec" 2>/dev/null | head -n 1 | sed "s/^[\"']//; s/[\"']\$//")
      cout=$(printf 'Authorization: Bearer %s\n' "$ckey" | curl -s --max-time 60 -o - -w '\n%{http_code}' -H @- \
        -H 'Content-Type: application/json' \
        --data "{\"model\": \"$cmodel\", \"max_tokens\": $ctok, \"temperature\": 0, \"messages\": [{\"role\": \"user\", \"content\": \"Say OK.\"}]}" \
        "http://127.0.0.1:$cport/v1/chat/completions" 2>/dev/null)
      printf 'chat\t%s\t%s\t%s\n' "$cport" "$(printf '%s' "$cout" | tail -n 1)" "$(printf '%s' "$cout" | sed '$d' | base64 -w0)" ;;
    free)
      p=$v
      while [ ! -e "$p" ] && [ "$p" != / ] && [ "$p" != . ]; do p=$(dirname -- "$p"); done
      a=$(df -B1 --output=avail -- "$p" 2>/dev/null | sed -n '2{s/ //g;p;}')
      case $a in ''|*[!0-9]*) a=- ;; esac
      printf 'free\t%s\t%s\n' "$v" "$a" ;;
    target)
      printf 'target\t%s\tmachine=%s\n' "$v" "$(uname -m)"
      printf 'target\t%s\tglibc=%s\n' "$v" "$(getconf GNU_LIBC_VERSION 2>/dev/null | cut -d' ' -f2)"
      if tpy=$(command -v -- "$v" 2>/dev/null); then
        # Debian's python3 is a link to python3.X: its name says the version (no interpreter
        # start); anything else (a venv's, pyenv's shim) is asked
        tname=$(readlink -f -- "$tpy" 2>/dev/null)
        tname=${tname##*/}
        tver=""
        case ${tname#python} in
          [0-9].[0-9]|[0-9].[0-9][0-9]) tver=${tname#python} ;;
        esac
        [ -n "$tver" ] || tver=$("$tpy" -S -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
        printf 'target\t%s\tpython=%s\n' "$v" "$tver"
      fi ;;
    gpus)
      if command -v nvidia-smi >/dev/null 2>&1; then
        printf 'gpus\t%s\t.\n' "$v"
        nvidia-smi --query-gpu="$v" --format=csv,noheader,nounits 2>/dev/null |
          while IFS= read -r l; do [ -n "$l" ] && printf 'gpus\t%s\t%s\n' "$v" "$l"; done
      else
        printf 'gpus\t%s\t-\n' "$v"
      fi ;;
    gpuapps)
      if command -v nvidia-smi >/dev/null 2>&1; then
        printf 'gpuapps\t%s\t.\n' "$v"
        nvidia-smi --query-compute-apps="$v" --format=csv,noheader,nounits 2>/dev/null |
          while IFS= read -r l; do [ -n "$l" ] && printf 'gpuapps\t%s\t%s\n' "$v" "$l"; done
        # every process with a GPU's device open (Xorg too: nvidia-smi lists compute processes
        # only): one find over /proc, then per process its cgroup and name
        set +f
        find /proc/[0-9]*/fd -mindepth 1 -maxdepth 1 -lname '/dev/nvidia[0-9]*' -printf '%h %l\n' 2>/dev/null | sort -u |
          while read -r d l; do
            p=${d#/proc/}; p=${p%/fd}
            cg=$(sed -n 's/^0:://p; s/^[0-9]*:name=systemd://p' "/proc/$p/cgroup" 2>/dev/null | head -n 1)
            printf 'gpupid\t%s\t%s\t%s\t%s\n' "$p" "${l#/dev/nvidia}" "${cg:--}" "$(cat "/proc/$p/comm" 2>/dev/null)"
          done
        # each GPU's /dev/nvidiaN minor, from the driver's own file (nvidia-smi has no such field:
        # "Field "minor_number" is not a valid field to query" on the H200's 580 driver)
        for f in /proc/driver/nvidia/gpus/*/information; do
          [ -r "$f" ] || continue
          u="" m=""
          while IFS= read -r l; do
            case $l in "GPU UUID:"*) u=${l#*:} ;; "Device Minor:"*) m=${l#*:} ;; esac
          done <"$f"
          u=$(echo $u) m=$(echo $m)
          [ -n "$u" ] && [ -n "$m" ] && printf 'gpuminor\t%s\t%s\n' "$u" "$m"
        done
        set -f
      else
        printf 'gpuapps\t%s\t-\n' "$v"
      fi ;;
    pci)
      printf 'pci\t%s\t.\n' "$v"
      set +f
      for d in "$v"/*; do
        if [ -r "$d/vendor" ] && [ -r "$d/class" ] && read -r pven <"$d/vendor" && read -r pcls <"$d/class"; then
          printf 'pci\t%s\t%s %s\n' "$v" "$pven" "$pcls"
        fi
      done
      set -f ;;
    user)
      if l=$(getent passwd -- "$v"); then printf 'user\t%s\t%s\n' "$v" "$l"; else printf 'user\t%s\t-\n' "$v"; fi ;;
    deb) debs="$debs $v" ;;
    unit) units="$units $v" ;;
    py) py=$v ;;
    pycode) code=$v ;;
    pyargs)
      if [ -x "$py" ]; then
        # shellcheck disable=SC2086  (ARGS are words: distribution and file names)
        "$py" -c "$code" $v 2>/dev/null | while IFS= read -r l; do printf 'py\t%s\t%s\n' "$py" "$l"; done
      fi
      printf 'py\t%s\t.\n' "$py" ;;
  esac
done
if [ -n "$debs" ] && command -v dpkg-query >/dev/null 2>&1; then
  # shellcheck disable=SC2086
  dpkg-query -W -f='deb\t${Package}\t${db:Status-Abbrev}\t${Version}\n' $debs 2>/dev/null
fi
if [ -n "$units" ] && command -v systemctl >/dev/null 2>&1; then
  # shellcheck disable=SC2086
  systemctl show --property=Id,LoadState,ActiveState,SubState,UnitFileState,NRestarts -- $units 2>/dev/null |
    while IFS= read -r l; do printf 'unit\t%s\n' "$l"; done
  now=$(date +%s)
  for u in $units; do  # ExecMainStartTimestamp is local time in words ("Wed 2026-12-02 01:50:00 UTC"): date reads it
    t=$(systemctl show -p ExecMainStartTimestamp --value -- "$u" 2>/dev/null)
    [ -n "$t" ] && [ "$t" != n/a ] && e=$(date -d "$t" +%s 2>/dev/null) && printf 'started\t%s\t%s\n' "$u" "$((now - e))"
  done
fi
echo end
