"""Build script: the package is pure Python; the optional C++ extension is added here."""

from setuptools import setup

setup()
