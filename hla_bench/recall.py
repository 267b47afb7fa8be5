"""Placeholder: the `recall` commands are being written."""

commands = []
