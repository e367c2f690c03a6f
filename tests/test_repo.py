"""Repository invariants: environment.yml and pyproject.toml install the same dependencies."""
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
