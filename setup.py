"""Terra: imperative-symbolic co-execution for TensorFlow 2 training loops.

TensorFlow itself is an extra (``cpu`` -> ``tensorflow-cpu``, ``gpu`` -> ``tensorflow``)
so that installing Terra never pulls a second TensorFlow next to the one you have.
"""

from setuptools import Extension, find_packages, setup

TF = "2.21.*"

setup(
    name="terra",
    version="0.1.0",
    description="Run imperative TensorFlow training loops at symbolic-graph speed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["terra", "terra.*", "benchmarks", "benchmarks.*"]),
    # The door and its common lanes in C (terra/lanes.py says what they do). Optional: where
    # it does not build, Terra runs the same lanes in Python, the same numbers, slower.
    ext_modules=[Extension("terra._native",
                           ["terra/_native_door.c", "terra/_native_twin.c",
                            "terra/_native_follow.c"],
                           depends=["terra/_native.h"], optional=True)],
    install_requires=["numpy", "gast>=0.5"],
    extras_require={
        "cpu": [f"tensorflow-cpu=={TF}"],
        "gpu": [f"tensorflow=={TF}"],
        "bench": ["scikit-learn", "matplotlib"],
        "test": ["pytest", "ruff", "scikit-learn", "matplotlib"],  # matplotlib: the profile view
        # The real-program corpus (benchmarks/corpus): libraries that would pull the full
        # `tensorflow` wheel next to tensorflow-cpu, so they are installed WITHOUT their
        # dependencies: pip install --no-deps <these> (docs/corpus.md has the exact line).
        "real": ["dm-sonnet==2.0.2", "dm-tree", "tabulate", "tensorflow-probability==0.25.0",
                 "decorator", "cloudpickle", "gpflow==2.11.2", "check-shapes", "dropstackframe",
                 "lark", "deprecated", "multipledispatch", "scipy", "tf-agents==0.19.0",
                 "gin-config", "gym==0.23.0", "gym-notices", "tensorboard"],
    },
)
