"""The A/B candidates (benchmarks/ab/*.patch) still apply to this tree, as the GPU script applies
them (patch -p1), and each is listed in the folder's README."""
import glob
import os
import shutil
import subprocess

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = sorted(glob.glob(os.path.join(REPO_ROOT, "benchmarks", "ab", "*.patch")))


@pytest.mark.skipif(shutil.which("patch") is None, reason="no patch(1) on this machine")
@pytest.mark.parametrize("path", PATCHES, ids=[os.path.basename(p) for p in PATCHES])
def test_patch_applies_to_this_tree(path):
    with open(path) as f:
        proc = subprocess.run(["patch", "-p1", "--dry-run", "--force", "-d", REPO_ROOT],
                              stdin=f, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", PATCHES, ids=[os.path.basename(p) for p in PATCHES])
def test_patch_is_described(path):
    with open(os.path.join(REPO_ROOT, "benchmarks", "ab", "README.md")) as f:
        readme = f.read()
    name = os.path.basename(path)[:-len(".patch")]
    assert f"| `{name}` |" in readme
