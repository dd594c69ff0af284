# nginx_keep.sh: keep a deployment's current nginx files before new ones are put (the nginx role),
# so that nginx_test_or_restore.sh can put them back when `nginx -t` fails. Run as root:
#     sh -c "$(cat nginx_keep.sh)" nginx-keep KEEP_DIR PATH...
# KEEP_DIR is emptied first (0700); a PATH that does not exist is not kept (it is removed on restore).
set -e
b=$1
shift
rm -rf "$b"
mkdir -p "$b"
chmod 700 "$b"
for p in "$@"; do
  if [ -e "$p" ]; then mkdir -p "$b${p%/*}" && cp -a "$p" "$b$p"; fi
done
