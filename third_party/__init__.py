"""Thin compatibility code for third-party engines, each beside its license notice."""
