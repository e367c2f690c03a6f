"""The environment record stored in every result file, with the copy bandwidth of this run."""
import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

from mingru.bench.places import REPO
from mingru.bench.timing import flushed_us


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(*cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state():
    """(commit, dirty). MINGRU_COMMIT, when set, names the commit the working tree was copied from
    (the GPU machine gets a copy whose .git may be stale or absent); dirty is then unknown (None)."""
    if os.environ.get("MINGRU_COMMIT"):
        return os.environ["MINGRU_COMMIT"], None
    commit = _run("git", "rev-parse", "HEAD")
    if commit is None:
        return "unknown", None
    return commit, bool(_run("git", "status", "--porcelain", "--untracked-files=no"))


def gpu_record():
    if not torch.cuda.is_available():
        return {"gpu": None, "gpu_capability": None, "gpu_sms": None, "gpu_memory_gb": None, "driver": None,
                "l2_mb": None}
    props = torch.cuda.get_device_properties(0)
    # nvidia-smi knows the driver version; torch only knows the CUDA driver API version.
    driver = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    if driver is None:
        try:
            api = torch._C._cuda_getDriverVersion()
            driver = f"CUDA driver API {api // 1000}.{api % 1000 // 10}"
        except (AttributeError, RuntimeError):
            driver = "unknown"
    return {"gpu": props.name, "gpu_capability": f"sm_{props.major}{props.minor}",
            "gpu_sms": props.multi_processor_count, "gpu_memory_gb": round(props.total_memory / 2**30, 1),
            "driver": driver.splitlines()[0],
            "l2_mb": round(getattr(props, "L2_cache_size", 0) / 2**20, 1) or None}


def copy_bandwidth(device):
    """Device-to-device copy of a buffer far larger than L2, in GB/s (bytes = read + write)."""
    n = 2**28 if torch.device(device).type == "cuda" else 2**22
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    us = flushed_us(lambda: dst.copy_(src), device)
    del src, dst
    return 2 * n * 4 / us / 1e3


def cpu_name():
    """The CPU's model name (from /proc/cpuinfo on Linux, else the platform's answer)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(device, smoke):
    commit, dirty = git_state()
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        **gpu_record(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "git_commit": commit,
        "git_dirty": dirty,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "smoke": smoke,
    }
    record["copy_gbps"] = copy_bandwidth(device)
    record["copy_method"] = ("dst.copy_(src) of 1 GiB float32, timing.flushed_us (do_bench median), bytes = 2 x size"
                             if record["device"].startswith("cuda") else
                             "dst.copy_(src) of 16 MiB float32 on the CPU, wall-clock median (smoke run)")
    return record
