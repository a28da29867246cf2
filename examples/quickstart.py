# One charge through poimen, offline: poimen.testing's provider process stands in for a payments
# API and counts the charges it takes. Run it twice: the second run is answered from the log.
from poimen import Caps, Completed, Idempotent, Indeterminate, Kernel, KeyDerivation, ToolContext
from poimen.testing import ProviderClient, ProviderProcess

with ProviderProcess("payments-ledger.db") as payments, Kernel("sqlite:///agent.db") as kernel:

    @kernel.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("order_id", "amount_cents")),
                 caps=Caps(hosts=("127.0.0.1",)), timeout=10)
    def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> dict:
        # ctx.http sends the kernel-derived key as Idempotency-Key; any other write is denied
        r = ctx.http.post(f"{payments.url}/keyed", json={"order": order_id, "cents": amount_cents})
        return r.json()

    kernel.launch()  # restart scan: settles whatever a previous crash left unfinished
    match kernel.call("charge", {"order_id": "o-17", "amount_cents": 4200}, call_id="run-9/step-3"):
        case Completed(result=r):
            print("charged:", r)
        case Indeterminate(intent_id=i):
            print(i, "is Indeterminate: an operator decides; poimen never guesses")
        case other:
            print(other)
    print("charges in the provider's ledger:", ProviderClient(payments.url).count())
