"""Placeholder: the `verify` commands are being written."""

commands = []
