"""What tests share: topologies of real processes, scripted stand-ins, fakes and builders.

Library code only: no tests and no fixtures here (conftest.py files wrap these in fixtures), and
no test module or conftest is ever imported (tests/test_layout.py checks it).
"""
