"""`make mutate`: mutation testing of the modules whose correctness is numeric or safety-critical.

Python modules go through mutmut (each target with the tests that name its behaviour); the C source
of the native fake-quant kernels, which mutmut cannot see (it is a string compiled at run time), gets
a fixed list of hand-written mutations run against the tests that pin the kernel. Results go to
``benchmarks/results/mutation.{json,md}``: killed / total per module, and every survivor with its diff
and, where one was reviewed, the reason it is equivalent (``benchmarks/mutation_equivalent.json``).

Each target runs in a scratch copy of the tree (mutmut writes ``mutants/`` beside the sources), so
the checkout is never touched. ``--only fake_quant`` runs one target; ``--max-children`` sets the
parallelism. ``make mutate`` runs the C-source set (about 2 minutes); ``MUTATE_TARGETS=all make mutate``
also runs mutmut over every Python target. ``--only NAME --recheck-survivors`` re-runs just the mutants
``mutation.json`` lists as surviving, against today's tests (after tests were written for them: a full run of
``export/validate.py`` takes about 35 minutes on 2 cores, its survivors a few).

mutmut runs the tests from its ``mutants/`` copy, so files the tests read outside the package (the YAML
configs under ``conf/``) are copied there too (``also_copy``); without them the stats run failed and every
mutant came out "no tests". A function that runs only at import time (``formats._dyn_block`` builds the
format table) cannot be activated by mutmut's trampolines, which pick the mutant when a function is
called in the forked test process: such survivors were applied to the source by hand and are listed with
the test that kills them (``benchmarks/mutation_equivalent.json``).

mutmut 3 does not mutate decorated functions (any decorator but ``staticmethod`` / ``classmethod``, at any
depth): the targets' functions take ``with torch.no_grad():`` as a block instead of ``@torch.no_grad()``
(``block_scale_search.py``), and the serving rules live in ``serve/refusals.py`` as plain functions,
because every FastAPI route is decorated.

The two-rank gloo test of the amax sync runs rank 0 in the test process, where mutmut sees which functions
a test reaches (it records that in the test process alone) and where the mutant is active; rank 1 is a
spawned interpreter that imports the unmutated package: a mutated rank against a correct peer, whose wrong
result, error or hang (the collectives time out) fails the test. The ranks run inside the test function, not in a
module-scoped fixture: mutmut attributes a function to the tests whose call reaches it, and work done in a
shared fixture was attributed to no test that checked it (the tensor-parallel mutants survived that way).

The tests run with one thread (``OMP_NUM_THREADS=1``): mutmut forks each mutant's test process from a
parent that already ran the tests, and GNU OpenMP's thread pool does not survive a fork, so before this every
mutant whose tests reached a parallel kernel hung until mutmut's timeout (all of the controller's first 14;
the formats run's 14 "timeouts" were 1 kill and 13 survivors).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EQUIVALENT = ROOT / "benchmarks" / "mutation_equivalent.json"

# module -> the tests that name its behaviour (mutmut runs, per mutant, those of them that execute it)
TARGETS: dict[str, dict] = {
    "fake_quant": {"module": "nemo_fp4qat/numerics/fake_quant.py",
                   "tests": ["tests/numerics/test_cpu_numerics.py", "tests/numerics/test_fake_quant_edges.py",
                             "tests/numerics/test_cpu_backend.py"]},
    "unpack": {"module": "nemo_fp4qat/export/unpack.py",
               "tests": ["tests/export/test_unpack.py", "tests/export/test_export.py"]},
    "layout": {"module": "nemo_fp4qat/export/layout.py", "tests": ["tests/export/test_export.py"]},
    "weight_check": {"module": "nemo_fp4qat/export/weight_check.py",
                     "tests": ["tests/export/test_weight_check.py", "tests/export/test_export.py"]},
    "validate": {"module": "nemo_fp4qat/export/validate.py", "tests": ["tests/export/test_export.py"]},
    "formats": {"module": "nemo_fp4qat/numerics/formats.py",
                "tests": ["tests/numerics/test_formats.py", "tests/qat/test_policy.py",
                          "tests/numerics/test_cpu_backend.py"]},
    "calibration": {"module": "nemo_fp4qat/qat/calibration/calibrate.py",
                    "tests": ["tests/qat/test_amax_sync.py", "tests/qat/test_calibration_data.py",
                              "tests/qat/test_bad_config.py"]},
    "batches": {"module": "nemo_fp4qat/qat/calibration/batches.py", "tests": ["tests/qat/test_calibration_data.py"]},
    "controller": {"module": "nemo_fp4qat/qat/controller.py",
                   "tests": ["tests/qat/test_controller.py", "tests/lightning/test_qat_callback.py",
                             "tests/qat/test_schedule.py", "tests/qat/test_bad_config.py",
                             "tests/qat/test_smoothing.py",
                             "tests/export/test_export.py::test_fp8_kv_cache_is_exported",
                             "tests/lightning/test_monitor.py::test_rollback_action_moves_the_group_back_one_stage"]},
    # the rules at their limits (fast, direct), and the HTTP tests that meet each refusal through a server
    "serve_validation": {"module": "nemo_fp4qat/serve/refusals.py",
                         "tests": ["tests/serve/test_refusals.py",
                                   "tests/serve/test_serve.py::test_bad_requests_get_4xx_naming_the_field",
                                   "tests/serve/test_serve.py::test_api_key_on_every_endpoint_but_health",
                                   "tests/serve/test_serve_openai.py::test_errors_the_client_sees",
                                   "tests/serve/test_serve_faults.py::test_oversize_bodies_get_413_declared_or_chunked",
                                   "tests/serve/test_serve_faults.py::"
                                   "test_a_non_ascii_api_key_is_refused_with_401_not_a_server_error"]},
    # with the two-rank test (20 s a mutant: it reaches every function) a full run takes over an hour; the
    # full run of record left it out (its survivors, the moments' all-reduce branch among them, were re-checked
    # with it)
    "block_scale_search": {"module": "nemo_fp4qat/qat/calibration/block_scale_search.py",
                           "tests": ["tests/qat/test_block_scale_search.py"]},
    "paired": {"module": "nemo_fp4qat/eval/paired.py", "tests": ["tests/eval/test_paired.py"]},
}  # fmt: skip
# the quick default (about 10 minutes on 2 cores): the C source and the format registry; MUTATE_TARGETS=all
# (or --only) runs every target
QUICK = ["c_kernel", "formats"]

# (what the mutation breaks, text in native_kernels._SOURCE, replacement)
C_MUTATIONS = [
    ("ties round half up instead of to even", "r = (r + 12582912.0f) - 12582912.0f;", "r = floorf(r + 0.5f);"),
    ("values above the format's max are not clamped", "return (a >= fmax) ? fmax : r;", "return r;"),
    ("subnormals use the normal exponent", "e = e < emin ? emin : e;", "e = e;"),
    ("NaN counts in the block amax", "bmax = (a > bmax) ? a : bmax;", "bmax = (a > bmax || a != a) ? a : bmax;"),
    ("NVFP4 block scale not clamped to 448", "if (!(ratio <= 448.f)) ratio = 448.f;", ""),
    ("NVFP4 block scale rounded with 2 mantissa bits", "round_minifloat(ratio, 3, -6, 448.f)",
     "round_minifloat(ratio, 2, -6, 448.f)"),
    ("AVX2: rounding quantum one binade too fine", "_mm256_set1_ps(1.5f * pow2i(23 - m))",
     "_mm256_set1_ps(1.5f * pow2i(22 - m))"),
    ("AVX2: no saturation", "return _mm256_min_ps(r, _mm256_set1_ps(fmax));", "return r;"),
    ("AVX2: subnormal binade not floored at emin", "p = _mm256_max_ps(p, _mm256_set1_ps(pow2i(emin)));", ""),
    ("AVX2: -0 keeps its sign", "_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ)",
     "_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ)"),
    ("AVX2: NaN input not passed through", "return _mm256_blendv_ps(o, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));",
     "return o;"),
    ("AVX2: block max over the first half of each block",
     "m[k] = _mm256_max_ps(v_abs(_mm256_loadu_ps(xc + 16 * k + 8)), a);", "m[k] = a;"),
]  # fmt: skip
C_TESTS = ["tests/numerics/test_cpu_numerics.py", "tests/numerics/test_native_vector_path.py", "-k", "native"]
# mutmut's CLI imported as a module, not run as __main__ (mutated functions import `mutmut.__main__`).
# `nemo_fp4qat` is pinned to mutmut's mutated copy by a finder placed first: this environment's editable
# install would otherwise resolve it to the checkout (so no test ever runs a mutant), and mutmut's own
# sys.path set-up drops the mutants directory when it runs from inside it.
MUTMUT = """
import importlib.machinery, os, sys
MUTANTS = os.path.abspath("mutants")
class _Mutated:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "nemo_fp4qat":
            return importlib.machinery.PathFinder.find_spec(name, [MUTANTS])
        return None
sys.meta_path.insert(0, _Mutated)
from mutmut.__main__ import cli
sys.argv[0] = "mutmut"
cli()
"""


def _scratch_copy() -> Path:
    """The tracked and new files of the checkout (not build outputs or environments) in a temp dir."""
    work = Path(tempfile.mkdtemp(prefix="nemo_fp4qat-mutate-"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()  # fmt: skip
    for f in files:
        src = ROOT / f
        if src.is_file():
            (work / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, work / f)
    return work


def run_c_kernel() -> dict:
    """Each C mutation compiled and run against the native-kernel tests; killed when a test fails."""
    results = []
    for what, old, new in C_MUTATIONS:
        work = _scratch_copy()
        path = work / "nemo_fp4qat/numerics/native_kernels.py"
        src = path.read_text()
        assert old in src, f"C mutation {what!r}: {old!r} is no longer in the kernel source"
        path.write_text(src.replace(old, new, 1))
        env = {**os.environ, "PYTHONPATH": str(work), "NEMO_FP4QAT_CACHE": str(work / ".cache")}
        res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *C_TESTS],
                             cwd=work, env=env, capture_output=True, text=True)  # fmt: skip
        failed = re.findall(r"^FAILED (\S+)", res.stdout, re.M)
        results.append({"mutation": what, "status": "killed" if res.returncode == 1 else
                        ("survived" if res.returncode == 0 else f"error {res.returncode}"),
                        "killed_by": failed[:1], "diff": f"- {old}\n+ {new}"})  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)
        print(f"  C kernel: {what}: {results[-1]['status']}", flush=True)
    return {"module": "nemo_fp4qat/numerics/native_kernels.py (C source)", "mutants": results}


def run_mutmut(name: str, max_children: int, only: list[str] | None = None) -> dict:
    """All mutants of target ``name``, or (``only``) just the named ones (their statuses alone are returned)."""
    spec = TARGETS[name]
    work = _scratch_copy()
    (work / "setup.cfg").write_text(
        "[mutmut]\nsource_paths=nemo_fp4qat/\n"
        f"only_mutate={spec['module']}\n"
        # mutmut runs the tests from mutants/: the YAML configs the tests read must be there too
        "also_copy=\n    conf/\n"
        + "pytest_add_cli_args_test_selection=\n" + "".join(f"    {t}\n" for t in spec["tests"])
    )  # fmt: skip
    # mutmut reads [tool.mutmut] from pyproject.toml first: this project keeps its config here instead.
    # One thread per test process: mutmut forks a child per mutant from a parent that has run the tests, and
    # GNU OpenMP's thread pool (the C kernels', torch's) does not survive a fork: a child's first parallel
    # region hangs and every such mutant ends as a "timeout". With one thread no pool is used (and the
    # children share the cores instead of each starting a thread per core).
    env = {**os.environ, "NEMO_FP4QAT_CACHE": str(work / ".cache"), "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    subprocess.run([sys.executable, "-c", MUTMUT, "run", "--max-children", str(max_children), *(only or [])],
                   cwd=work, env=env)  # fmt: skip
    meta = json.loads((work / "mutants" / (spec["module"] + ".meta")).read_text())
    codes = meta["exit_code_by_key"]
    status = {1: "killed", 3: "killed", -24: "timeout", 0: "survived", 33: "no tests", 5: "no tests",
              34: "skipped", 36: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", -11: "segfault"}  # fmt: skip
    mutants = []
    for key, code in sorted(codes.items()):
        if only is not None and key not in only:
            continue
        st = status.get(code, "not checked" if code is None else f"exit {code}")
        entry = {"mutant": key, "status": st}
        if st in ("survived", "no tests"):
            shown = subprocess.run([sys.executable, "-c", MUTMUT, "show", key], cwd=work, env=env,
                                   capture_output=True, text=True).stdout  # fmt: skip
            entry["diff"] = "\n".join(ln for ln in shown.splitlines() if ln.startswith(("+", "-")) and
                                      not ln.startswith(("+++", "---")))  # fmt: skip
        mutants.append(entry)
    shutil.rmtree(work, ignore_errors=True)
    return {"module": spec["module"], "tests": spec["tests"], "wall_s": round(time.time() - t0), "mutants": mutants,
            "source_sha256": _source_hash(spec["module"])}  # fmt: skip


def _source_hash(module: str) -> str:
    """mutmut numbers a module's mutants in source order: after an edit the same name is another mutation."""
    import hashlib

    return hashlib.sha256((ROOT / module).read_bytes()).hexdigest()


def _score(r: dict) -> tuple[int, int]:
    ms = [m for m in r["mutants"] if m["status"] not in ("not checked", "skipped")]
    return sum(m["status"] in ("killed", "timeout") for m in ms), len(ms)


def write_results(results: dict[str, dict]) -> None:
    equivalent = json.loads(EQUIVALENT.read_text()) if EQUIVALENT.is_file() else {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mutation.json").write_text(json.dumps(results, indent=1))
    lines = ["# Mutation testing (`make mutate`, written by benchmarks/run_mutation.py)", "",
             "| module | tests | killed | timeout | survived | no tests | score | survivors explained |",
             "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    detail = []
    for r in results.values():
        killed, total = _score(r)
        survivors = [m for m in r["mutants"] if m["status"] in ("survived", "no tests")]
        explained = [m for m in survivors if (m.get("mutant") or m.get("mutation")) in equivalent]
        tests = ", ".join(r.get("tests", C_TESTS[:1]))
        n = {st: sum(m["status"] == st for m in r["mutants"]) for st in ("killed", "timeout", "survived", "no tests")}
        lines.append(f"| `{r['module']}` | {tests} | {n['killed']} | {n['timeout']} | {n['survived']} | "
                     f"{n['no tests']} | {killed} / {total} = {killed / max(total, 1):.0%} | "
                     f"{len(explained)} of {len(survivors)} |")  # fmt: skip
        for m in survivors:
            key = m.get("mutant") or m.get("mutation")
            why = equivalent.get(key, "not yet reviewed")
            detail += [f"### {key} ({m['status']})", "", f"Reason: {why}", "", "```diff", m.get("diff", ""), "```", ""]
    lines += [f"\n`{r['module']}`: the {r['full_run_survivors']} survivors of the full run were re-run against the "
              "tests written for them (`run_mutation.py --recheck-survivors`); the other mutants' statuses are from "
              "the full run." for r in results.values() if r.get("full_run_survivors")]  # fmt: skip
    lines += ["", "Score = (killed + timeout) / all mutants: killed = a test failed with the mutant in place;",
              "timeout = mutmut stopped the tests past its time limit (a mutant that loops, or a busy machine:",
              "rerun on an idle one); no tests = no selected test calls the mutated function (counted as",
              "surviving). Survivors below, each with its diff and, when reviewed, why it is equivalent or which",
              "test kills it when applied by hand (`benchmarks/mutation_equivalent.json`).", "",
              *detail]  # fmt: skip
    (RESULTS / "mutation.md").write_text("\n".join(lines) + "\n")


def recheck_survivors(results: dict[str, dict], names: list[str], max_children: int) -> int:
    """The survivors of a full run (``results``: mutation.json), re-run against today's tests: new tests written
    for them show here as kills (a full run of a large module takes most of an hour; its survivors, minutes)."""
    for name in names:
        old = results[name]
        if old.get("source_sha256") not in (None, _source_hash(old["module"])):
            raise SystemExit(f"{old['module']} changed since its full run: its mutant names now denote other "
                             "mutations, so its survivors cannot be re-checked by name; run a full run "
                             f"(--only {name})")  # fmt: skip
        # "not checked": left by a re-check whose clean test run failed (its mutants never ran)
        keys = [m["mutant"] for m in old["mutants"] if m["status"] in ("survived", "no tests", "not checked")]
        print(f"re-checking {len(keys)} survivors of {name} ...", flush=True)
        new = {m["mutant"]: m for m in run_mutmut(name, max_children, only=keys)["mutants"]}
        old["mutants"] = [new.get(m.get("mutant"), m) for m in old["mutants"]]
        old["tests"] = TARGETS[name]["tests"]  # the re-check ran today's test list
        old.setdefault("full_run_survivors", len(keys))  # the first re-check sees the full run's survivors
        write_results(results)
        killed, total = _score(old)
        print(f"{name}: {killed} / {total} killed", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help=f"targets: c_kernel, {', '.join(TARGETS)}, or 'all' (default: quick)")
    p.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    p.add_argument("--report", action="store_true", help="only rewrite mutation.md from mutation.json")
    p.add_argument("--recheck-survivors", action="store_true",
                   help="re-run only the mutants mutation.json lists as surviving")  # fmt: skip
    args = p.parse_args()
    if args.report:
        write_results(json.loads((RESULTS / "mutation.json").read_text()))
        return 0
    if args.recheck_survivors:
        measured = json.loads((RESULTS / "mutation.json").read_text())
        names = args.only or []
        missing = [n for n in names if n not in TARGETS or n not in measured]
        if not names or missing:
            what = f"{missing} have no full run in mutation.json" if missing else "no target was given"
            p.error(f"--recheck-survivors needs --only NAME... ({what}); targets with a full run: "
                    f"{', '.join(n for n in TARGETS if n in measured)}")  # fmt: skip
        return recheck_survivors(measured, names, args.max_children)
    names = args.only or os.environ.get("MUTATE_TARGETS", "").split() or QUICK
    if names == ["all"]:
        names = ["c_kernel", *TARGETS]
    previous = json.loads((RESULTS / "mutation.json").read_text()) if (RESULTS / "mutation.json").is_file() else {}
    for name in names:
        print(f"mutating {name} ...", flush=True)
        previous[name] = run_c_kernel() if name == "c_kernel" else run_mutmut(name, args.max_children)
        write_results(previous)  # after each target: a long run interrupted keeps what it measured
        killed, total = _score(previous[name])
        print(f"{name}: {killed} / {total} killed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
