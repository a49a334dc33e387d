"""Host memory in transparent huge pages: a 2 MiB boundary, zeroed, a map Linux may back
with huge pages; none under one huge page or with the switch off."""

from __future__ import annotations

from minivllm.utils.huge_pages import HUGE_PAGE, huge_page_bytes


def transparent_huge_pages() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def thp_eligible(address: int) -> bool:
    """Whether the map holding ``address`` may take transparent huge pages (smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(x, 16) for x in first.split("-"))
                inside = low <= address < high
            elif inside and first == "THPeligible:":
                return line.split()[1] == "1"
    return False


def test_whole_huge_pages_from_a_2_mib_boundary_read_zero():
    nbytes = 2 * HUGE_PAGE + 4096  # two whole huge pages and a tail of ordinary ones
    pages = huge_page_bytes(nbytes)
    assert pages is not None and pages.numel() == nbytes
    assert pages.data_ptr() % HUGE_PAGE == 0 and not pages.any()
    if transparent_huge_pages():  # a private map: a shared one (shmem) is never eligible
        assert thp_eligible(pages.data_ptr())
    pages[-1] = 7
    assert pages[-1] == 7 and not pages[:-1].any()


def test_ordinary_memory_under_one_huge_page_or_with_the_switch_off(monkeypatch):
    assert huge_page_bytes(HUGE_PAGE - 64) is None
    monkeypatch.setenv("MINIVLLM_CPU_HUGE_PAGES", "0")
    assert huge_page_bytes(4 * HUGE_PAGE) is None
