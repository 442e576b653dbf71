"""kernels/hub_shadow.py: this folder imported as the top-level ``kernels`` hands the name to an
installed ``kernels`` distribution (transformers >= 5.25 imports Hugging Face's at import time),
and stays itself where there is none."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import sys; sys.path[:0] = sys.argv[1:]; import kernels, vexact_models.kernels as ours; "
         "print(getattr(kernels, 'HUB', False), kernels is ours, Path(kernels.__file__).parent.parent == Path(sys.argv[1]))")


def probe(*paths: Path) -> list[str]:
    code = "from pathlib import Path; " + PROBE
    done = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_top_level_kernels_is_the_installed_distribution_where_there_is_one(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("HUB = True\n")
    assert probe(ROOT, tmp_path) == ["True", "False", "False"]  # the distribution's, though the repository is first


def test_hand_over_skips_the_repository_root_and_needs_a_package_elsewhere(tmp_path, monkeypatch):
    """A package found only in the repository root is not handed over (the folder stays itself);
    one found elsewhere on ``sys.path`` is loaded under the name."""
    from vexact_models.kernels.hub_shadow import hand_over

    for folder, text in ((tmp_path / "repo", "WHERE = 'repo'\n"), (tmp_path / "site", "WHERE = 'site'\n")):
        (folder / "vexact_probe_pkg").mkdir(parents=True)
        (folder / "vexact_probe_pkg" / "__init__.py").write_text(text)
    init = tmp_path / "repo" / "vexact_probe_pkg" / "__init__.py"
    monkeypatch.setattr(sys, "path", [str(tmp_path / "repo")] + sys.path)
    monkeypatch.delitem(sys.modules, "vexact_probe_pkg", raising=False)
    assert not hand_over("vexact_probe_pkg", str(init)) and "vexact_probe_pkg" not in sys.modules
    monkeypatch.setattr(sys, "path", sys.path + [str(tmp_path / "site")])
    assert hand_over("vexact_probe_pkg", str(init)) and sys.modules["vexact_probe_pkg"].WHERE == "site"
