"""Repository invariants: environment.yml and pyproject.toml install the same dependencies; nothing
refers to a path outside the repository; the wheelhouse pins what `make peers` unpacks."""
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])
    env = (ROOT / "environment.yml").read_text()
    pip_section = env.split("- pip:", 1)[1]
    listed = set(re.findall(r"^\s+- (\S+)\s*$", pip_section, flags=re.M))
    assert listed == wanted


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for command in ["make setup", "make test"]:
        assert command in readme.split("\n## ", 1)[0], f"{command} is not among the README's first commands"
        assert command in ci


def _tracked():
    import subprocess
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


OUTSIDE = "../" + "shared"  # the helpers' folder beside a checkout, which a clone does not have


def test_nothing_refers_to_a_path_outside_the_repository():
    offenders = [p.relative_to(ROOT) for p in _tracked()
                 if p.suffix in (".py", ".sh", ".txt", ".toml", ".yml", "") and OUTSIDE in p.read_text(errors="ignore")]
    assert not offenders


def test_the_wheelhouse_pins_the_competitors_that_make_peers_unpacks():
    listed = re.findall(r"^--peer (\S+)$", (ROOT / "tools" / "wheelhouse.txt").read_text(), flags=re.M)
    unpacked = re.findall(r"^unpack \S+ (.+)$", (ROOT / "tools" / "peers.sh").read_text(), flags=re.M)
    assert set(listed) == {pin for line in unpacked for pin in line.split()}
    assert {"mingru-scans==0.2.0", "minGRU-pytorch==0.2.1", "fla-core==0.6.0", "accelerated-scan==0.3.1"} <= set(listed)
    runners = (ROOT / "tools" / "wheelhouse.txt").read_text()
    for name in ("papermill", "ipykernel", "nbval", "tqdm"):
        assert re.search(rf"^{name}==", runners, flags=re.M), name
