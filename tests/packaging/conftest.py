"""Packaging tests: the systemd unit and the Debian package (tests/packaging/test_install.py)."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "packaging: builds the Debian package and installs it into a fresh debootstrap root "
        "(root, network to the Debian archive and the Python index; opt in with MLLMD_INSTALL_TEST=1)"
    )
