"""Placeholder: the `report` commands are being written."""

commands = []
