"""A real DNS server on loopback, for discovery tests: answers A, AAAA and SRV queries from
records a test changes while it runs, over UDP on a port the OS picks."""

from __future__ import annotations

import socket
import threading

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class LoopbackDNS:
    """``records[(name, type)]``: rdata texts (``"127.0.0.1"``, ``"0 0 8001 pod-a.svc."``);
    a name without records is NXDOMAIN. SRV answers carry their targets' A/AAAA records as
    additional data, as Kubernetes' DNS does. ``queries`` counts what it answered."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = {}
        self.queries = 0
        self.silent = False  # drop every query: a DNS outage
        # Answer every query with this response code and no records (YXDOMAIN, REFUSED,
        # ...), as a misconfigured or hostile server might; None: answer from the records.
        self.rcode: dns.rcode.Rcode | None = None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, rdtype: str, values: list[str]) -> None:
        with self._lock:
            key = (dns.name.from_text(name).to_text(), rdtype)
            if values:
                self.records[key] = list(values)
            else:
                self.records.pop(key, None)

    def __enter__(self) -> LoopbackDNS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                wire, client = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            if self.silent:
                continue
            try:
                query = dns.message.from_wire(wire)
            except dns.exception.DNSException:
                continue
            self.sock.sendto(self._answer(query).to_wire(), client)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        if self.rcode is not None:
            response.set_rcode(self.rcode)
            return response
        response.flags |= dns.flags.AA
        question = query.question[0]
        name, rdtype = question.name.to_text(), dns.rdatatype.to_text(question.rdtype)
        with self._lock:
            self.queries += 1
            values = self.records.get((name, rdtype), [])
            known = any(key[0] == name for key in self.records)
            if values:
                response.answer.append(self._rrset(name, rdtype, values))
            if rdtype == "SRV":
                for value in values:
                    target = value.split()[-1]
                    for kind in ("A", "AAAA"):
                        if glue := self.records.get((target, kind)):
                            response.additional.append(self._rrset(target, kind, glue))
        if not known:
            response.set_rcode(dns.rcode.NXDOMAIN)
        return response

    @staticmethod
    def _rrset(name: str, rdtype: str, values: list[str]) -> dns.rrset.RRset:
        return dns.rrset.from_text_list(name, 5, dns.rdataclass.IN, rdtype, values)
