"""Placeholder: the `bench` commands are being written."""

commands = []
