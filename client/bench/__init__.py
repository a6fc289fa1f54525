"""Benchmarks, one package: `eyas bench peers | tree | service | runtime | forward | trace | groups | failover | profile`,
on the shared harness.

Speed claims are ratios measured side by side in one run on one machine; every benchmark writes
one JSON record (and `peers` optional PNG charts).
"""
