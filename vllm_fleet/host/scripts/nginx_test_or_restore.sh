# nginx_test_or_restore.sh: `nginx -t` after new nginx files of a deployment were put (the nginx
# role); when it fails, the files nginx_keep.sh kept are put back (a PATH that was not there is
# removed), it says so and exits 1, before any reload: nginx stays as it was. Run as root:
#     sh -c "$(cat nginx_test_or_restore.sh)" nginx-test-or-restore NAME KEEP_DIR PATH...
name=$1 b=$2
shift 2
if nginx -t; then rm -rf "$b"; exit 0; fi
for p in "$@"; do
  if [ -e "$b$p" ]; then cp -a "$b$p" "$p"; else rm -f "$p"; fi
done
rm -rf "$b"
echo "vllm-fleet: nginx -t failed with the new site of $name (nginx's message above): its previous nginx files are back and nginx was not reloaded" >&2
nginx -t >/dev/null 2>&1 && echo 'vllm-fleet: nginx -t passes again' >&2
exit 1
