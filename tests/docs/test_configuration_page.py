"""The configuration page names every RINGSERVE_* variable and every command-line flag the code
reads, and nothing the code does not read (docs/guide/configuration.md against the source)."""

from __future__ import annotations

import re

import inventory
import yaml


def compose_variables() -> set[str]:
    """Variables the compose file itself reads (RINGSERVE_IMAGE): documented, though no Python reads them."""
    text = (inventory.ROOT / "docker-compose.yml").read_text()
    yaml.safe_load(text)  # a compose file that does not parse fails here, not in a regex
    return set(re.findall(r"\$\{(RINGSERVE_[A-Z0-9_]+)", text))


def test_every_variable_the_code_reads_is_on_the_configuration_page() -> None:
    documented, _ = inventory.documented()
    missing = sorted(inventory.variables_read() - documented)
    assert not missing, f"{inventory.CONFIG_PAGE.name} does not name {missing}: add a row for each"


def test_the_configuration_page_names_no_variable_the_code_does_not_read() -> None:
    documented, _ = inventory.documented()
    stale = sorted(documented - inventory.variables_read() - compose_variables())
    assert not stale, f"{inventory.CONFIG_PAGE.name} names {stale}, which nothing reads any more"


def test_every_command_line_flag_is_on_the_configuration_page() -> None:
    _, documented = inventory.documented()
    missing = {where: sorted(flags - documented) for where, flags in inventory.flags_read().items() if flags - documented}
    assert not missing, f"{inventory.CONFIG_PAGE.name} does not name these flags: {missing}"


def test_the_configuration_page_names_no_flag_that_does_not_exist() -> None:
    _, documented = inventory.documented()
    known = set().union(*inventory.flags_read().values())
    assert not documented - known, f"{inventory.CONFIG_PAGE.name} names flags no parser has: {sorted(documented - known)}"


def test_the_inventory_finds_variables_read_by_name_and_through_config_fields() -> None:
    found = inventory.variables_read()
    # Read by name (torch.distributed's settings) and built from a field name (from_env), both.
    assert {"RINGSERVE_COMPRESSION", "RINGSERVE_CHUNK_BYTES", "RINGSERVE_HEARTBEAT_TIMEOUT_S"} <= found
    assert {"-np", "--min-np", "--service"} <= set().union(*inventory.flags_read().values())
