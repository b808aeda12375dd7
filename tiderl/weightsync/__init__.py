"""Weights from the trainer to the engines without files: the wire format, the trainer's server, the engines' client."""
