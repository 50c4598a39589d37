set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/backends" KVGROUPS_CACHE_DIR=/tmp/kvg_cubins
timeout 90 python3 .diag/lw_profile.py 2>&1 | grep -v Warn | tail -8
