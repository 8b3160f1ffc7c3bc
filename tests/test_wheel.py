"""The wheel carries what the package reads at run time: built with `pip wheel`, installed (not editable)
into a fresh virtual environment that borrows only the third-party packages of this one, then the CLI's
`formats` and the demo's corpus and preset loading run from the installed copy."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_and_runs_outside_the_source_tree(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, text=True)  # fmt: skip
    (wheel,) = wheels.glob("nemo_fp4qat-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "nemo_fp4qat/demo/data/emma.txt" in names and "nemo_fp4qat/demo/data/persuasion.txt" in names
    assert "nemo_fp4qat/export/deployed_model.py" in names and "nemo_fp4qat/demo/data/smollm2_auto_policy.yaml" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    # third-party packages from this environment (a plain path entry: its editable-install hooks do not run)
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)  # fmt: skip
    code = (
        "import nemo_fp4qat, pathlib; from nemo_fp4qat.demo.model import load_corpus; "
        "from nemo_fp4qat.cli import main; "
        "assert 'site-packages' in nemo_fp4qat.__file__, nemo_fp4qat.__file__; "
        "assert len(load_corpus('emma')) > 100000; "
        "assert nemo_fp4qat.LayerPolicy.preset('default').runtime == 'trtllm'; "
        "from nemo_fp4qat.demo.pipeline import DemoConfig; assert DemoConfig().layer_policy().rules; "
        "raise SystemExit(main(['formats']))"
    )
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "nvfp4" in res.stdout and "W4A8" not in res.stderr
