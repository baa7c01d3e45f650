// A payment tool on Node.js, written as tools are: Stripe's PaymentIntents with the official
// `stripe` package (default settings), built-in fetch, or axios, and the secret key from
// STRIPE_API_KEY. Nothing here names the proxy or its CA: the worker's environment does
// (tests/it/sdk_matrix.rs). One invocation is one run of the tool.
//
//     node tool.mjs CLIENT INVOICE AMOUNT      CLIENT: stripe | fetch | axios
//
// Prints one JSON line: {"status", "id", "replayed"}, or {"error"} with what was thrown (for
// a Stripe error also its HTTP status, Stripe error type and code), and `seconds`, how long the
// call took.
import axios from 'axios';
import Stripe from 'stripe';

const URL = 'https://api.stripe.com/v1/payment_intents';
const [client, invoice, amount] = process.argv.slice(2);
const key = process.env.STRIPE_API_KEY;
const form = new URLSearchParams({
  amount,
  currency: 'usd',
  payment_method: 'pm_card_visa',
  confirm: 'true',
  'metadata[invoice_id]': invoice,
}).toString();
const headers = { authorization: `Bearer ${key}`, 'content-type': 'application/x-www-form-urlencoded' };

const tools = {
  async stripe() {
    const pi = await new Stripe(key).paymentIntents.create({
      amount: Number(amount),
      currency: 'usd',
      payment_method: 'pm_card_visa',
      confirm: true,
      metadata: { invoice_id: invoice },
    });
    return { status: 200, id: pi.id, replayed: pi.lastResponse.headers['idempotent-replayed'] };
  },
  async fetch() {
    const r = await fetch(URL, { method: 'POST', headers, body: form });
    return { status: r.status, id: (await r.json()).id, replayed: r.headers.get('idempotent-replayed') };
  },
  async axios() {
    const r = await axios.post(URL, form, { headers, timeout: 20000 });
    return { status: r.status, id: r.data.id, replayed: r.headers['idempotent-replayed'] };
  },
};

let out;
const started = performance.now();
try {
  out = await tools[client]();
} catch (e) {
  const cause = e.cause ? `: ${e.cause.code || e.cause.message}` : '';
  out = {
    error: `${e.constructor.name}${e.code ? ` ${e.code}` : ''}`,
    message: `${e.message}${cause}`.slice(0, 600),
    // What stripe-node read from Stripe's error shape (undefined for other errors).
    status: e.statusCode,
    type: e.type,
    code: e.code,
  };
}
// How long the call took, the SDK's own retries included.
out.seconds = Math.round(performance.now() - started) / 1000;
console.log(JSON.stringify(out));
