"""Helpers for ringserve's own tests and benchmarks; not shipped in the wheel.

``ringserve.testing.pki`` makes a throwaway certificate authority and certificates for TLS tests
(needs ``cryptography``, from the ``dev`` extra). setuptools excludes this package from built
distributions (pyproject.toml), so it is importable from a checkout (an editable install) only.
"""
