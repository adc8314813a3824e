#!/usr/bin/env bash
# The drop-in suite: small PyTorch programs that work with PyTorch's own CUDA allocator, each
# run twice, with it and with vmm (VMM_TORCH_ENABLE=1), under `timeout 60`. One line per case:
#
#   case native_rc vmm_rc verdict   (ok | VMM-BREAKS | known-gap | gap-closed | native-fails |
#                                    not-run)
#
# then the tail of stderr of each failing run and a summary. A case exits 0 when the behaviour
# is PyTorch's and says on stderr what differed otherwise. known_gaps.txt lists the cases vmm
# is known to fail (docs/DESIGN.md says why): they report known-gap; one that passes reports
# gap-closed. Exit status 0 when every case is ok or known-gap.
#
#   tests/gpu/dropin/run.sh [VMM_SITE] [case names...]     (tests/gpu/run.sh dropin runs it)
#
# VMM_SITE (or the VMM_PY variable): the folder vmm_torch is pip-installed into, as
# tests/gpu/run.sh does it (`pip install --target /tmp/vmm_site ./torch_plugin/python`, the
# default). If it holds no vmm_torch and .gpu/lib/libvmm.so exists (tests/gpu/prepare.sh), it
# is installed there the same way. A folder installed with --target is not a site folder, so
# the package's vmm_torch_autoenable.pth (what makes VMM_TORCH_ENABLE work in every process)
# would not run: a sitecustomize that calls site.addsitedir(VMM_SITE) is put first on
# PYTHONPATH (it chains to any sitecustomize it hides). Both modes get the same PYTHONPATH.
# JOBS (default 8): cases run at once; cases marked "# EXCLUSIVE" run alone afterwards.
# DROPIN_UNTIL (seconds since the epoch): a run that would begin after it is not begun; its
# case reports not-run (rc "-"), so that a time-boxed caller still gets the table of the rest.
# OUT: results go to $OUT/dropin when set, else /tmp/dropin_results.
# VMM_ENABLE_TEXT: the value of VMM_TORCH_ENABLE in the vmm runs (default 1; e.g.
# handle_type=posix_fd). Fabric handles need an IMEX channel (tests/gpu/run.sh makes one).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root" || exit 1
[[ -d /opt/torch/.venv/bin ]] && export PATH="/opt/torch/.venv/bin:$PATH"
[[ -d "$root/.gpu/lib" ]] && export LD_LIBRARY_PATH="$root/.gpu/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
VMM_ENABLE_TEXT=${VMM_ENABLE_TEXT:-1}

site_dir=${VMM_PY:-/tmp/vmm_site}
if [[ $# -gt 0 && -d "$1" ]]; then
  site_dir=$1
  shift
fi
site_dir="$(mkdir -p "$site_dir" && cd "$site_dir" && pwd)"
if [[ ! -e "$site_dir/vmm_torch/__init__.py" ]]; then
  if [[ -e "$root/.gpu/lib/libvmm.so" ]]; then
    echo "installing vmm_torch into $site_dir (as tests/gpu/run.sh does)"
    env VMM_LIB="$root/.gpu/lib/libvmm.so" python3 -m pip install -q --no-build-isolation \
      --no-deps --no-index --target "$site_dir" ./torch_plugin/python || exit 1
  else
    echo "no vmm_torch in $site_dir and no .gpu/lib/libvmm.so to install it from" >&2
    exit 1
  fi
fi

results=${OUT:+$OUT/dropin}
results=${results:-/tmp/dropin_results}
rm -rf "$results"
mkdir -p "$results/customize"
cat >"$results/customize/sitecustomize.py" <<EOF
import importlib.machinery, importlib.util, os, site, sys
site.addsitedir(${site_dir@Q})
_here = os.path.dirname(os.path.abspath(__file__))
_path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _path)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
EOF
export PYTHONPATH="$results/customize:$site_dir${PYTHONPATH:+:$PYTHONPATH}"

# (bounded: ended with this script, bench/bounded.sh.)
# shellcheck source=bench/bounded.sh
source "$root/bench/bounded.sh"

# Ended from outside (a caller's `timeout`, Ctrl-C): each case runs under its own `timeout`,
# the leader of a process group of its own, which that signal does not reach; end those groups
# too, so that no case outlives the runner and runs beside what its caller starts next.
mkdir -p "$results/running"
stop_cases() {
  # Ignored, not reset: `timeout` signals its child and then the child's whole group, so a
  # second TERM follows the first at once and would end this trap half done.
  trap '' TERM INT HUP
  touch "$results/running/stop"  # run_one begins no more runs
  local f p seen=() i
  # Until the runs end, end each case listed (one begun after a look is listed at the next).
  while :; do
    for f in "$results"/running/*.{native,vmm}; do
      [[ -e $f ]] || continue
      p=$(<"$f")
      seen+=("$p")
      kill -TERM -- "$p" "-$p" 2>/dev/null
    done
    [[ -n ${runner:-} ]] && kill -0 "$runner" 2>/dev/null || break
    sleep 0.1
  done
  # The cases' processes (a CUDA program takes a while to exit) are gone before the caller's
  # next step begins: 10 s, then KILL.
  for i in $(seq 100); do
    for p in "${seen[@]}"; do kill -0 -- "-$p" 2>/dev/null && break; p=; done
    [[ -z ${p:-} ]] && break
    sleep 0.1
  done
  for p in "${seen[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
  exit "$1"
}
trap 'stop_cases 143' TERM
trap 'stop_cases 130' INT
trap 'stop_cases 129' HUP

# Both modes must be what they claim, or every verdict is meaningless. A probe runs as a case
# does (bounded, listed in running/, in the background and waited for), so that the runner
# ended during one ends it too: a command substitution would hold off the trap until it ended.
probe='import torch, vmm_torch; torch.empty(1, device="cuda"); print(vmm_torch.enabled_hooks() or "native", torch.__version__)'
# probe_in MODE: the probe's output in $results/probe.MODE.out.
probe_in() {
  local mode=$1 bounded_pid_file="$results/running/probe.$1"
  if [[ $mode == native ]]; then
    bounded 120 env -u VMM_TORCH_ENABLE python3 -c "$probe" >"$results/probe.$mode.out" 2>&1
  else
    bounded 120 env VMM_TORCH_ENABLE="$VMM_ENABLE_TEXT" python3 -c "$probe" \
      >"$results/probe.$mode.out" 2>&1
  fi
}
for mode in native vmm; do
  probe_in "$mode" &
  runner=$!
  wait "$runner"
  runner=
done
native_probe=$(tail -n 1 "$results/probe.native.out")
vmm_probe=$(tail -n 1 "$results/probe.vmm.out")
echo "native mode: $native_probe"
echo "vmm mode:    $vmm_probe"
if [[ "$vmm_probe" != *vmm_cuda_allocator* ]]; then
  echo "VMM_TORCH_ENABLE=$VMM_ENABLE_TEXT did not make vmm's full CUDA allocator current" \
    "(the probe's output: $results/probe.vmm.out); stopping" >&2
  exit 1
fi
if [[ "$native_probe" != native* ]]; then
  echo "vmm is enabled without VMM_TORCH_ENABLE (the probe's output:" \
    "$results/probe.native.out); stopping" >&2
  exit 1
fi

if [[ $# -gt 0 ]]; then
  cases=()
  for name in "$@"; do cases+=("$here/case_${name#case_}"); done
  cases=("${cases[@]/%.py/}")
  cases=("${cases[@]/%/.py}")
else
  cases=("$here"/case_*.py)
fi

# run_one FILE MODE: one run, rc and stderr into $results.
run_one() {
  local file=$1 mode=$2 name
  name=$(basename "$file" .py)
  if [[ -e "$results/running/stop" ||
        ( -n "${DROPIN_UNTIL:-}" && $(date +%s) -ge $DROPIN_UNTIL ) ]]; then
    echo - >"$results/$name.$mode.rc"
    return
  fi
  local start=$SECONDS rc
  # bench/bounded.sh: `timeout` makes its own process group, which a signal to the runner's
  # group does not reach; a run signalled ends its case, and the runner, signalled alone, ends
  # the cases listed in running/ (stop_cases).
  local bounded_pid_file="$results/running/$name.$mode"
  if [[ $mode == native ]]; then
    bounded 60 env -u VMM_TORCH_ENABLE python3 "$file" >"$results/$name.$mode.out" \
      2>"$results/$name.$mode.err"
  else
    bounded 60 env VMM_TORCH_ENABLE="$VMM_ENABLE_TEXT" python3 "$file" \
      >"$results/$name.$mode.out" 2>"$results/$name.$mode.err"
  fi
  rc=$?
  echo $rc >"$results/$name.$mode.rc"
  echo $((SECONDS - start)) >"$results/$name.$mode.time"
}
export -f run_one bounded
export results VMM_ENABLE_TEXT DROPIN_UNTIL

started=$SECONDS
parallel=() exclusive=()
for f in "${cases[@]}"; do
  [[ -e "$f" ]] || { echo "no such case: $f" >&2; continue; }
  if grep -q '^# EXCLUSIVE' "$f"; then exclusive+=("$f"); else parallel+=("$f"); fi
done
if [[ ${#parallel[@]} -gt 0 ]]; then
  # In the background and waited for: a trapped signal interrupts `wait`, not a pipeline.
  for f in "${parallel[@]}"; do printf '%s native\n%s vmm\n' "$f" "$f"; done |
    xargs -P "${JOBS:-8}" -n 2 bash -c 'run_one "$0" "$1"' &
  runner=$!
  wait "$runner"
  runner=
fi
for f in "${exclusive[@]}"; do
  for mode in native vmm; do
    run_one "$f" "$mode" &  # waited for, as above
    runner=$!
    wait "$runner"
    runner=
  done
done

# known_gaps.txt: a case name per line, then its reason (# comments).
known=" $(sed -e 's/#.*//' "$here/known_gaps.txt" | tr -s ' \n' ' ') "
ok=0 breaks=0 nfail=0 gaps=0 closed=0 notrun=0
lines=() details=()
for f in "${parallel[@]}" "${exclusive[@]}"; do
  name=$(basename "$f" .py)
  n=$(cat "$results/$name.native.rc" 2>/dev/null || echo "?")
  v=$(cat "$results/$name.vmm.rc" 2>/dev/null || echo "?")
  gap=0
  [[ $known == *" ${name#case_} "* ]] && gap=1
  if [[ $n == - || $v == - ]]; then
    verdict=not-run
    ((notrun++))
  elif [[ $n == 0 && $v == 0 && $gap == 1 ]]; then
    verdict=gap-closed
    ((closed++))
  elif [[ $n == 0 && $v == 0 ]]; then
    verdict=ok
    ((ok++))
  elif [[ $n == 0 && $gap == 1 ]]; then
    verdict=known-gap
    ((gaps++))
  elif [[ $n == 0 ]]; then
    verdict=VMM-BREAKS
    ((breaks++))
    details+=("--- $name: vmm rc=$v ($(cat "$results/$name.vmm.time")s)$([[ $v == 124 ]] && echo ' TIMEOUT')"
              "$(tail -n 12 "$results/$name.vmm.err")")
  else
    verdict=native-fails
    ((nfail++))
    details+=("--- $name: native rc=$n ($(cat "$results/$name.native.time")s)$([[ $n == 124 ]] && echo ' TIMEOUT')"
              "$(tail -n 12 "$results/$name.native.err")")
  fi
  lines+=("$(printf '%-40s %4s %4s %s' "${name#case_}" "$n" "$v" "$verdict")")
done
printf '%-40s %4s %4s %s\n' case native vmm verdict
printf '%s\n' "${lines[@]}"
if [[ ${#details[@]} -gt 0 ]]; then
  echo
  printf '%s\n' "${details[@]}"
fi
echo
echo "summary: ${#lines[@]} cases: $ok ok, $breaks VMM-BREAKS, $gaps known-gap," \
  "$closed gap-closed, $nfail native-fails, $notrun not-run ($((SECONDS - started)) s; logs in" \
  "$results)"
[[ $breaks -eq 0 && $nfail -eq 0 && $closed -eq 0 && $notrun -eq 0 ]]
